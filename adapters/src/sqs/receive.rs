//! Receiving: long polls run in tasks of their own (so a receive the runtime abandons gives its
//! messages back), FIFO group order, optional read-ahead, and giving back what never started.

use std::sync::atomic::Ordering;
use std::time::Duration;

use aws_sdk_sqs::types::MessageSystemAttributeName;
use tracing::Instrument;

use super::config::{MAX_BATCH, visibility_secs};
use super::delivery::SqsDelivery;
use super::error::{SqsError, bounded, classify};
use super::source::SqsSource;
use super::state::ReceiveResult;
use crate::runtime::ReceiveContext;
use crate::source::Incoming;

/// How long before a receive's answer arrived its messages' visibility may have started.
const RECEIVE_SLACK: Duration = Duration::from_secs(1);

/// While FIFO messages wait behind their group, how long one idle wait for more lasts.
const PARKED_POLL: Duration = Duration::from_millis(500);

impl SqsSource {
    /// One `ReceiveMessage` call, cancellation-safe: the call runs in a task of its own, so when the
    /// caller stops waiting (the runtime shutting down drops its receive), messages SQS hands to
    /// the abandoned long poll are made visible again at once instead of staying hidden for the
    /// visibility timeout.
    async fn receive_messages(&self, max: usize, wait: Duration, visibility: i32) -> ReceiveResult {
        self.spawn_receive(max, wait, visibility).await.unwrap_or_else(|_| {
            Err(SqsError::Transient { operation: "ReceiveMessage", code: None, message: "receive task ended".into() })
        })
    }

    /// Starts a `ReceiveMessage` call in a task; its answer comes through the returned channel, or
    /// is given back to SQS (visibility 0) if nobody is there to take it.
    fn spawn_receive(
        &self,
        max: usize,
        wait: Duration,
        visibility: i32,
    ) -> tokio::sync::oneshot::Receiver<ReceiveResult> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let this = self.clone();
        self.inner.receiving.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(
            async move {
                let result = this.receive_call(max, wait, visibility).await;
                if let Err(Ok(orphans)) = tx.send(result)
                    && !orphans.is_empty()
                {
                    tracing::info!(n = orphans.len(), "receive abandoned by its caller: giving the messages back");
                    this.give_back_all(&orphans).await;
                }
                this.inner.receiving.fetch_sub(1, Ordering::AcqRel);
                this.inner.idle.notify_waiters();
            }
            .in_current_span(),
        );
        rx
    }

    /// Visibility 0 for deliveries the runtime never got.
    async fn give_back_all(&self, deliveries: &[SqsDelivery]) {
        if deliveries.is_empty() {
            return;
        }
        let items = deliveries.iter().map(|d| (d.0.message_id.clone(), 0)).collect();
        if let Err(e) = self.change_visibility(items, self.inner.config.call_timeout).await {
            tracing::warn!(error = %e, n = deliveries.len(), "could not give back unstarted messages");
        }
    }

    async fn receive_call(&self, max: usize, wait: Duration, visibility: i32) -> Result<Vec<SqsDelivery>, SqsError> {
        let n = i32::try_from(max.clamp(1, MAX_BATCH)).unwrap_or(10);
        let wait = i32::try_from(wait.as_secs().min(20)).unwrap_or(20);
        let mut call = self
            .inner
            .client
            .receive_message()
            .queue_url(&self.inner.config.queue_url)
            .max_number_of_messages(n)
            .wait_time_seconds(wait)
            .visibility_timeout(visibility)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            // All message attributes: a key may come from one, and a dead-letter copy keeps them.
            .message_attribute_names("All");
        // Group and deduplication ids exist on FIFO queues only; asking for them elsewhere costs
        // the endpoint work for nothing (measurably, on LocalStack).
        if self.inner.config.fifo {
            call = call
                .message_system_attribute_names(MessageSystemAttributeName::MessageDeduplicationId)
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .message_system_attribute_names(MessageSystemAttributeName::SequenceNumber);
        }
        let sent = tokio::time::Instant::now();
        let limit = Duration::from_secs(u64::try_from(wait).unwrap_or(20)) + self.inner.config.call_timeout;
        let out =
            bounded("ReceiveMessage", limit, async { call.send().await.map_err(|e| classify("ReceiveMessage", e)) })
                .await
                .map_err(|e| self.name_missing_queue(e))?;
        // SQS starts a message's visibility timeout when it hands the message out: during a long
        // poll, any time between the call and its answer, in practice just before the answer.
        // Count from the answer less a slack for its way back (never before the call was sent).
        let started = tokio::time::Instant::now().checked_sub(RECEIVE_SLACK).map_or(sent, |t| t.max(sent));
        let mut deliveries = Vec::new();
        for m in out.messages.unwrap_or_default() {
            match self.inner.registry.register(m, Some((started, visibility))) {
                Ok(d) => deliveries.push(d),
                Err(e) => tracing::error!(error = %e, "SQS returned an unusable message; skipped"),
            }
        }
        Ok(deliveries)
    }

    /// Gives back to SQS (visibility 0) every message this source received but the runtime never
    /// started: read ahead, parked behind a FIFO group, or arriving on a long poll the runtime
    /// abandoned when it stopped. Waits up to `timeout` for such polls to end. Call it after
    /// [`Consumer::run`](crate::Consumer::run) returns, so those messages come back now rather
    /// than after their visibility timeout. Returns how many messages were given back.
    ///
    /// ```no_run
    /// # async fn demo(consumer: brokerfence::Consumer<brokerfence::sqs::SqsSource>) {
    /// consumer.run(|ctx: brokerfence::JobContext| async move { Ok(Vec::new()) }, brokerfence::shutdown_signal()).await.ok();
    /// consumer.source().release_unstarted(std::time::Duration::from_secs(25)).await;
    /// # }
    /// ```
    pub async fn release_unstarted(&self, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inner.idle.notified();
            if self.inner.receiving.load(Ordering::Acquire) == 0
                || tokio::time::timeout_at(deadline, notified).await.is_err()
            {
                break;
            }
        }
        let mut unstarted: Vec<SqsDelivery> = Vec::new();
        {
            let mut ahead = self.inner.ahead.lock().await;
            for (_, mut rx) in ahead.pending.drain(..).collect::<Vec<_>>() {
                if let Ok(Ok(v)) = rx.try_recv() {
                    unstarted.extend(v);
                }
            }
            unstarted.extend(ahead.buffer.drain(..).map(|(_, d)| d));
        }
        unstarted.extend(self.inner.registry.drain_parked());
        self.give_back_all(&unstarted).await;
        if !unstarted.is_empty() {
            tracing::info!(n = unstarted.len(), "unstarted messages given back");
        }
        unstarted.len()
    }

    pub(super) async fn receive_inner(
        &self,
        max: usize,
        ctx: &ReceiveContext,
    ) -> Result<Vec<Incoming<SqsDelivery>>, SqsError> {
        let config = &self.inner.config;
        let registry = &self.inner.registry;
        registry.set_lease(ctx.lease.get());
        self.receive_count_checked().await?;
        let visibility = visibility_secs(config.visibility.unwrap_or(ctx.lease.get()));
        if !config.fifo {
            let received = self.receive_standard(max, visibility).await?;
            tracing::debug!(got = received.len(), "received");
            return Ok(received.into_iter().map(|d| self.incoming(d)).collect());
        }
        loop {
            if config.fifo {
                let ready = registry.take_ready(max);
                if !ready.is_empty() {
                    return Ok(ready.into_iter().map(|d| self.incoming(d)).collect());
                }
            }
            let parked = config.fifo && registry.has_parked();
            let wait = if parked { Duration::ZERO } else { config.wait_time };
            let received = self.receive_messages(max, wait, visibility).await?;
            let (received, blocked) = registry.admit(received);
            if !blocked.is_empty() {
                // Later messages of a group whose head is kept in the queue: not started before
                // it, hidden until after it comes back.
                let items = blocked.iter().map(|(d, secs)| (d.0.message_id.clone(), *secs)).collect();
                if let Err(e) = self.change_visibility(items, config.call_timeout).await {
                    tracing::warn!(error = %e, n = blocked.len(), "could not hide messages waiting behind their group's head");
                }
                drop(blocked);
            }
            if !received.is_empty() || !parked {
                tracing::debug!(got = received.len(), "received");
                return Ok(received.into_iter().map(|d| self.incoming(d)).collect());
            }
            // Messages wait behind their group: wake when one is ready, or look for new groups.
            let _ = tokio::time::timeout(
                PARKED_POLL.min(config.wait_time.max(Duration::from_millis(50))),
                registry.ready.notified(),
            )
            .await;
        }
    }

    /// A standard queue's receive. `max` may exceed SQS's ten per call: while the queue has a
    /// backlog, several `ReceiveMessage` calls fill one batch (one claim statement for all of
    /// them), and the next batch is read ahead while the runtime claims this one.
    async fn receive_standard(&self, max: usize, visibility: i32) -> ReceiveResult {
        let entered = tokio::time::Instant::now();
        let config = &self.inner.config;
        let mut ahead = self.inner.ahead.lock().await;
        // A message read ahead and left waiting too long is given back rather than handed out
        // with little of its visibility left.
        let max_age = Duration::from_secs(u64::try_from(visibility).unwrap_or(0)) / 2;
        let now = tokio::time::Instant::now();
        let mut stale = Vec::new();
        while ahead.buffer.front().is_some_and(|(at, _)| now.duration_since(*at) > max_age) {
            if let Some((_, d)) = ahead.buffer.pop_front() {
                stale.push(d);
            }
        }
        // Answers of receives sent ahead, oldest first; each awaited in place, so that if the
        // runtime drops this receive, the answer stays for the next one.
        while ahead.buffer.len() < max
            && let Some((at, rx)) = ahead.pending.front_mut()
        {
            let at = *at;
            let answer = rx.await;
            ahead.pending.pop_front();
            match answer {
                Ok(Ok(v)) => {
                    ahead.backlog = v.len() >= MAX_BATCH;
                    ahead.buffer.extend(v.into_iter().map(|d| (at, d)));
                }
                Ok(Err(e)) => {
                    ahead.backlog = false;
                    return Err(e);
                }
                Err(_) => ahead.backlog = false,
            }
        }
        if ahead.buffer.is_empty() {
            // Nothing in hand: one long poll. A full answer means a backlog: fill the batch with
            // more calls at once, without waiting.
            let first = self.receive_messages(max, config.wait_time, visibility).await?;
            ahead.backlog = first.len() >= MAX_BATCH;
            let sent = tokio::time::Instant::now();
            ahead.buffer.extend(first.into_iter().map(|d| (sent, d)));
            if ahead.backlog && max > MAX_BATCH {
                let more = max - ahead.buffer.len();
                let calls: Vec<_> = (0..more.div_ceil(MAX_BATCH))
                    .map(|i| self.spawn_receive((more - i * MAX_BATCH).min(MAX_BATCH), Duration::ZERO, visibility))
                    .collect();
                for rx in calls {
                    match rx.await {
                        Ok(Ok(v)) => {
                            ahead.backlog = v.len() >= MAX_BATCH;
                            ahead.buffer.extend(v.into_iter().map(|d| (sent, d)));
                        }
                        Ok(Err(e)) => tracing::debug!(error = %e, "extra receive failed"),
                        Err(_) => {}
                    }
                }
            }
        }
        let n = max.min(ahead.buffer.len());
        let out: Vec<SqsDelivery> = ahead.buffer.drain(..n).map(|(_, d)| d).collect();
        tracing::trace!(
            max,
            out = out.len(),
            left = ahead.buffer.len(),
            backlog = ahead.backlog,
            took_us = entered.elapsed().as_micros() as u64,
            "batch"
        );
        // Read ahead: the next batch is on its way while the runtime claims this one.
        if config.read_ahead && ahead.backlog && ahead.pending.is_empty() && ahead.buffer.len() < max {
            let want = max - ahead.buffer.len();
            let sent = tokio::time::Instant::now();
            for i in 0..want.div_ceil(MAX_BATCH) {
                let n = (want - i * MAX_BATCH).min(MAX_BATCH);
                let rx = self.spawn_receive(n, if i == 0 { config.wait_time } else { Duration::ZERO }, visibility);
                ahead.pending.push_back((sent, rx));
            }
        }
        drop(ahead);
        if !stale.is_empty() {
            tracing::debug!(n = stale.len(), "read-ahead messages waited too long; given back");
            self.give_back_all(&stale).await;
        }
        Ok(out)
    }
}
