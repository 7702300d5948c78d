//! What the broker was told, the source side: lease-loss events, tagged deliveries, and the
//! source wrapper that prints every delivery's outcome.

use super::*;

/// A delivery with the job key it maps to (none for a malformed one).
#[derive(Clone)]
pub struct Tagged<D> {
    inner: D,
    key: Option<JobKey>,
}

impl<D> Tagged<D> {
    fn key(&self) -> String {
        self.key.as_ref().map_or_else(|| "-".to_owned(), |k| k.as_str().to_owned())
    }
}

/// A [`Source`] that prints what the broker was told, as the runtime's disposition says:
/// `acked`, `hidden` (visibility changed: `why=busy|retry|heartbeat`), `dead_lettered`,
/// `abandoned`, and `broker_error` when a call failed. Every call is delegated.
pub struct EventSource<S>(pub S);

impl<S: Source> EventSource<S> {
    fn queue_name(&self) -> &QueueName {
        self.0.queue()
    }

    fn outcome(&self, op: &str, key: &str, r: &Result<(), SourceError>, ok: impl FnOnce()) {
        match r {
            Ok(()) => ok(),
            Err(e) => {
                let error = e.to_string();
                event("broker_error", &[("queue", self.queue_name()), ("key", &key), ("op", &op), ("error", &error)]);
            }
        }
    }

    /// `EVENT <name> queue=… key=… [extra…]` for one delivery.
    fn delivery_event(&self, name: &str, key: &str, extra: &[(&str, &dyn Display)]) {
        let mut fields: Vec<(&str, &dyn Display)> = vec![("queue", self.queue_name()), ("key", &key)];
        fields.extend_from_slice(extra);
        event(name, &fields);
    }
}

#[async_trait]
impl<S: Source> Source for EventSource<S> {
    type Delivery = Tagged<S::Delivery>;

    fn queue(&self) -> &QueueName {
        self.0.queue()
    }

    fn kind(&self) -> &'static str {
        self.0.kind()
    }

    fn check(&self) -> Result<(), SourceError> {
        self.0.check()
    }

    fn default_batch(&self) -> usize {
        self.0.default_batch()
    }

    fn receives_in_flight(&self) -> usize {
        self.0.receives_in_flight()
    }

    fn default_prefetch(&self, concurrency: usize) -> usize {
        self.0.default_prefetch(concurrency)
    }

    async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<Self::Delivery>>, SourceError> {
        let got = self.0.receive(max, ctx).await?;
        Ok(got
            .into_iter()
            .map(|incoming| match incoming {
                Incoming::Unclaimed { delivery, key, payload } => {
                    Incoming::Unclaimed { delivery: Tagged { inner: delivery, key: Some(key.clone()) }, key, payload }
                }
                Incoming::Claimed { delivery, job } => {
                    Incoming::Claimed { delivery: Tagged { inner: delivery, key: Some(job.lease.key.clone()) }, job }
                }
                Incoming::Malformed { delivery, reason } => {
                    Incoming::Malformed { delivery: Tagged { inner: delivery, key: None }, reason }
                }
            })
            .collect())
    }

    async fn extend(&self, leases: &[(Lease, Self::Delivery)]) -> Result<(), SourceError> {
        let inner: Vec<(Lease, S::Delivery)> = leases.iter().map(|(l, d)| (l.clone(), d.inner.clone())).collect();
        let r = self.0.extend(&inner).await;
        for (lease, d) in leases {
            self.outcome("extend", &d.key(), &r, || {
                let ms = lease.ttl.as_millis();
                lease_event("hidden", lease, &[("why", &"heartbeat"), ("ms", &ms)]);
            });
        }
        r
    }

    async fn lost(&self, leases: &[(Lease, Self::Delivery)]) -> Result<(), SourceError> {
        let inner: Vec<(Lease, S::Delivery)> = leases.iter().map(|(l, d)| (l.clone(), d.inner.clone())).collect();
        self.0.lost(&inner).await
    }

    async fn ack(&self, deliveries: Vec<Self::Delivery>) -> Result<(), SourceError> {
        let keys: Vec<String> = deliveries.iter().map(Tagged::key).collect();
        let r = self.0.ack(deliveries.into_iter().map(|d| d.inner).collect()).await;
        for key in &keys {
            self.outcome("ack", key, &r, || self.delivery_event("acked", key, &[]));
        }
        r
    }

    async fn retry_later(&self, delivery: Self::Delivery, delay: Duration) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.retry_later(delivery.inner, delay).await;
        let ms = delay.as_millis();
        self.outcome("retry_later", &key, &r, || {
            self.delivery_event("hidden", &key, &[("why", &"retry"), ("ms", &ms)])
        });
        r
    }

    async fn dead_letter(&self, delivery: Self::Delivery, reason: &str) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.dead_letter(delivery.inner, reason).await;
        self.outcome("dead_letter", &key, &r, || self.delivery_event("dead_lettered", &key, &[("reason", &reason)]));
        r
    }

    async fn hold(&self, delivery: Self::Delivery, ttl: Duration) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.hold(delivery.inner, ttl).await;
        let ms = ttl.as_millis();
        self.outcome("hold", &key, &r, || self.delivery_event("hidden", &key, &[("why", &"busy"), ("ms", &ms)]));
        r
    }

    async fn abandon(&self, delivery: Self::Delivery) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.abandon(delivery.inner).await;
        self.outcome("abandon", &key, &r, || self.delivery_event("abandoned", &key, &[]));
        r
    }

    async fn close(&self, grace: Duration) {
        self.0.close(grace).await;
    }
}
