//! Issue #12, the SQS edges, against LocalStack: bounded calls (§1), the RedrivePolicy check and a
//! queue without a dead-letter queue (§3), FIFO group order, stale receipt handles and the
//! retrofit's heartbeat hook (§4). Each test has its own queue(s) and PostgreSQL schema.
#![cfg(feature = "sqs")]

use brokerfence_testkit::sqs as sqs_support;

mod edges {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use brokerfence::sqs::aws_sdk_sqs::error::SdkError;
    use brokerfence::sqs::aws_sdk_sqs::types::{
        MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry,
    };
    use brokerfence::sqs::{
        DeadLetterTarget, KeyStrategy, REASON_ATTRIBUTE, ReceiveCountCheck, SqsConfig, SqsDelivery, SqsError,
        SqsRetrofit, SqsSource, SqsTimeouts,
    };
    use brokerfence::{
        Claim, FenceStore, JobContext, JobError, JobKey, JobState, Lease, LeaseDuration, Owner, PgFence, RetryPolicy,
        SupervisorConfig,
    };
    use brokerfence::{Consumer, ConsumerConfig, Incoming, Reason, ReceiveContext, Source, SourceError};
    use sqlx::AssertSqlSafe;
    use tokio_util::sync::CancellationToken;

    use super::sqs_support::*;

    fn secs(n: u64) -> LeaseDuration {
        LeaseDuration::from_secs(n).expect("lease")
    }

    /// Receives through `source` until one delivery comes (or panics after `within`).
    async fn receive_one(source: &SqsSource, lease: LeaseDuration, within: Duration) -> Incoming<SqsDelivery> {
        let ctx =
            ReceiveContext { owner: Owner::new("edges-receiver").expect("owner"), lease, shutdown: Default::default() };
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut got = source.receive(1, &ctx).await.expect("receive");
            if let Some(first) = got.pop() {
                return first;
            }
            assert!(tokio::time::Instant::now() < deadline, "nothing received within {within:?}");
        }
    }

    fn unclaimed(i: Incoming<SqsDelivery>) -> (SqsDelivery, JobKey) {
        match i {
            Incoming::Unclaimed { delivery, key, .. } => (delivery, key),
            other => panic!("expected a keyed delivery, got {other:?}"),
        }
    }

    async fn claim(fence: &PgFence, queue: &str, key: &JobKey, owner: &str, lease: u64) -> Claim {
        fence
            .claim(
                &brokerfence::QueueName::new(queue).expect("queue"),
                key,
                &Owner::new(owner).expect("owner"),
                secs(lease),
            )
            .await
            .expect("claim")
    }

    async fn claimed(fence: &PgFence, queue: &str, key: &JobKey, owner: &str, lease: u64) -> Lease {
        let q = brokerfence::QueueName::new(queue).expect("queue");
        match fence.claim(&q, key, &Owner::new(owner).expect("owner"), secs(lease)).await.expect("claim") {
            Claim::Claimed(l) => l,
            other => panic!("expected a claim for {key}, got {other:?}"),
        }
    }

    /// §1 bullet 2 (SQS): the visibility extension that follows a confirmed heartbeat is bounded
    /// by a third of the lease time left, even on a client that sets no timeout at all (a user's
    /// own client); deletes by the source's call timeout, receives by their wait plus that.
    /// Guard: a broker that stops answering (a stalled proxy in front of LocalStack) costs a
    /// typed timeout error within lease/3, never a hung heartbeat hook or settle task.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_extend_is_bounded_by_a_third_of_the_lease() {
        init_tracing();
        let client = sqs().await;
        let fence = pg().await;
        let q = TestQueue::new(&client, "bound", 30).await;
        let proxy = SqsProxy::start("bound", ProxyLog::default()).await;
        send(&client, &q.url, "x").await;
        let config = SqsConfig::new(&q.url).expect("url").wait_time(Duration::from_secs(1));
        let source = SqsSource::new(proxy.client().await, config);
        let (d, key) = unclaimed(receive_one(&source, secs(3), Duration::from_secs(10)).await);
        let lease = claimed(&fence, &q.name, &key, "bound", 3).await;
        // Through the proxy while it forwards: the extension works.
        source.extend_visibility(&[(lease.clone(), d.clone())]).await.expect("extend while the broker answers");

        proxy.stall(true);
        let started = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), source.extend_visibility(&[(lease.clone(), d.clone())]))
            .await
            .expect("extend_visibility hung on a stalled broker (no bound)");
        let took = started.elapsed();
        let e = r.expect_err("a stalled broker cannot have answered");
        assert!(matches!(e, SqsError::Timeout { after: Some(_), .. }), "typed timeout expected: {e:?}");
        assert!(e.is_transient(), "{e}");
        assert!(took <= lease.ttl / 3 + Duration::from_millis(500), "took {took:?}, lease ttl {:?}", lease.ttl);
        // The other calls the source makes are bounded by its call timeout; a receive by its wait
        // time plus that.
        let config = SqsConfig::new(&q.url)
            .expect("url")
            .wait_time(Duration::from_secs(1))
            .call_timeout(Duration::from_secs(1))
            // (the RedrivePolicy read of the first receive would be one more bounded call)
            .check_receive_count(RetryPolicy::default(), ReceiveCountCheck::Off);
        let bounded = SqsSource::new(proxy.client().await, config);
        let d2 = bounded.delivery(d.message().clone()).expect("delivery");
        let started = Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(10), bounded.delete(std::slice::from_ref(&d2)))
            .await
            .expect("delete hung")
            .expect_err("stalled");
        assert!(matches!(e, SqsError::Timeout { .. }), "{e:?}");
        assert!(started.elapsed() < Duration::from_millis(1800), "took {:?}", started.elapsed());
        let ctx =
            ReceiveContext { owner: Owner::new("bound").expect("owner"), lease: secs(3), shutdown: Default::default() };
        let started = Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(10), bounded.receive(1, &ctx))
            .await
            .expect("receive hung")
            .expect_err("stalled");
        assert!(matches!(e, SourceError::Transient(_)), "{e:?}");
        assert!(started.elapsed() < Duration::from_millis(2800), "took {:?}", started.elapsed());
        proxy.stall(false);
        q.delete(&client).await;
        drop_schema(&fence).await;
    }

    /// §1 bullet 2 (SQS): `sqs::client(aws_config::from_env(), SqsTimeouts::default())` sets an
    /// operation and an attempt timeout.
    /// Guard: the default client never waits forever on a call.
    #[tokio::test]
    async fn edges_client_from_env_sets_operation_timeouts() {
        let client = brokerfence::sqs::client(
            brokerfence::sqs::aws_config::from_env(),
            brokerfence::sqs::SqsTimeouts::default(),
        )
        .await;
        let t = client.config().timeout_config().cloned().expect("a timeout config");
        assert_eq!(t.operation_timeout(), Some(Duration::from_secs(60)), "{t:?}");
        assert_eq!(t.operation_attempt_timeout(), Some(Duration::from_secs(25)), "{t:?}");
        assert!(t.connect_timeout().is_some(), "{t:?}");
    }

    /// §1 bullet 2 (SQS): a client built the way `sqs::client` builds it, with short
    /// timeouts, gives up on a stalled broker (a proxy that stops forwarding) with a typed
    /// timeout within the operation timeout. Guard: no SQS call through such a client hangs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_client_timeouts_end_a_stalled_call() {
        init_tracing();
        let client = sqs().await;
        let q = TestQueue::new(&client, "stall", 30).await;
        let proxy = SqsProxy::start("stall", ProxyLog::default()).await;
        let timeouts = SqsTimeouts::default().attempt(Duration::from_millis(700)).operation(Duration::from_secs(2));
        let through = brokerfence::sqs::client(proxy.loader(), timeouts).await;
        through.get_queue_url().queue_name(&q.name).send().await.expect("works while the proxy forwards");

        proxy.stall(true);
        let started = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(15),
            through.get_queue_attributes().queue_url(&q.url).attribute_names(QueueAttributeName::All).send(),
        )
        .await
        .expect("the call hung: no timeout");
        let e = r.expect_err("a stalled broker cannot have answered");
        assert!(matches!(e, SdkError::TimeoutError(_)), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
        // The source types it.
        let config = SqsConfig::new(&q.url).expect("url").call_timeout(Duration::from_secs(30));
        let source = SqsSource::new(through, config);
        let started = Instant::now();
        let e = source.dead_letter_queue_url().await.expect_err("stalled");
        assert!(matches!(e, SqsError::Timeout { after: None, .. }), "{e:?}");
        assert!(e.is_transient());
        assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
        proxy.stall(false);
        q.delete(&client).await;
    }

    /// §3 bullet 2: a RedrivePolicy whose maxReceiveCount is below what the retry policy needs
    /// (one receive per attempt plus headroom for holds and takeovers) is named at start, with
    /// the numbers and the fix; in `Refuse` mode the consumer does not start. Guard: SQS cannot
    /// silently dead-letter jobs the database still retries.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_max_receive_count_too_low_is_refused() {
        init_tracing();
        let client = sqs().await;
        let fence = pg().await;
        let low = TestQueue::with_dlq(&client, "mrc-low", 3, 2).await;
        let fits = TestQueue::with_dlq(&client, "mrc-ok", 3, 8).await;
        let none = TestQueue::new(&client, "mrc-none", 3).await;
        let policy = RetryPolicy { max_attempts: 5, ..RetryPolicy::default() };

        let source = |url: &str| {
            SqsSource::new(
                client.clone(),
                SqsConfig::new(url)
                    .expect("url")
                    .wait_time(Duration::from_secs(1))
                    .check_receive_count(policy, ReceiveCountCheck::Refuse),
            )
        };
        let e = source(&low.url).check_max_receive_count(&policy).await.expect_err("2 < 5 + 3");
        match &e {
            SqsError::MaxReceiveCountTooLow { max_receive_count: 2, needed: 8, attempts: 5, headroom: 3, .. } => {}
            other => panic!("{other:?}"),
        }
        let text = e.to_string();
        for want in ["maxReceiveCount is 2", "needs 8", "max_attempts = 5", "raise maxReceiveCount to at least 8"] {
            assert!(text.contains(want), "{text:?} should say {want:?}");
        }
        assert_eq!(source(&fits.url).check_max_receive_count(&policy).await.expect("fits"), Some(8));
        assert_eq!(source(&none.url).check_max_receive_count(&policy).await.expect("no policy"), None);

        // Refuse: the consumer stops at its first receive, with the message.
        send(&client, &low.url, "x").await;
        let consumer = Consumer::new(
            source(&low.url),
            dyn_store(&fence),
            ConsumerConfig::new(SupervisorConfig::new(secs(3)).retry(policy)),
        );
        let r = tokio::time::timeout(
            Duration::from_secs(15),
            consumer.run(|ctx: JobContext| async move { Ok(ctx.payload().to_vec()) }, CancellationToken::new()),
        )
        .await
        .expect("the consumer should refuse, not run");
        match r {
            Err(SourceError::Fatal(m)) => assert!(m.to_string().contains("maxReceiveCount is 2"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(consumer.metrics().snapshot().claims, 0);
        // Warn (the default) runs on.
        let warn = SqsSource::new(
            client.clone(),
            SqsConfig::new(&low.url).expect("url").check_receive_count(policy, ReceiveCountCheck::Warn),
        );
        let got = receive_one(&warn, secs(3), Duration::from_secs(10)).await;
        assert!(matches!(got, Incoming::Unclaimed { .. }));
        for q in [low, fits, none] {
            q.delete(&client).await;
        }
        drop_schema(&fence).await;
    }

    /// §3 bullet 4 (SQS part): a message without a job key on a queue without a dead-letter
    /// queue. Guards: the typed error names the API that exists
    /// (`SqsConfig::dead_letter(DeadLetterTarget::Queue(url))`, `--dead-letter-queue`), the
    /// retrofit's `dead_letters` counter counts only real moves, and with a dead-letter queue
    /// the message is moved once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_no_dead_letter_queue_is_an_actionable_error() {
        init_tracing();
        let client = sqs().await;
        let fence = pg().await;
        let q = TestQueue::new(&client, "nodlq", 3).await;
        send(&client, &q.url, "not json {").await;
        send(&client, &q.url, "not json either {").await;
        let config = SqsConfig::new(&q.url).expect("url").key(KeyStrategy::body_field("id"));
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while got.len() < 2 && tokio::time::Instant::now() < deadline {
            got.extend(receive_raw(&client, &q.url, 1).await);
        }
        assert_eq!(got.len(), 2, "both malformed messages received");

        // The retrofit: the move fails, and is not counted as a dead letter.
        let retro = SqsRetrofit::new(
            dyn_store(&fence),
            SqsSource::new(client.clone(), config.clone()),
            SupervisorConfig::new(secs(3)),
        );
        let out = retro.process(&got[0], |_ctx: JobContext| async move { Ok::<_, JobError>(Vec::new()) }).await;
        let e = out.broker_error.expect("no dead-letter queue: the move fails");
        let e = std::error::Error::source(&e).and_then(|c| c.downcast_ref::<SqsError>());
        assert!(matches!(e, Some(SqsError::NoDeadLetterQueue { .. })), "{e:?}");
        assert_eq!(retro.metrics().snapshot().dead_letters, 0, "a failed move is no dead letter");

        // The source, as the runtime calls it: a typed error that names what to set.
        let source = SqsSource::new(client.clone(), config);
        let d = source.delivery(got[1].clone()).expect("delivery");
        let reason = match source.incoming(d) {
            Incoming::Malformed { reason, .. } => reason,
            other => panic!("{other:?}"),
        };
        let d = source.delivery(got[1].clone()).expect("delivery");
        let e = source.move_to_dead_letter(&d, &reason).await.expect_err("no dead-letter queue");
        let text = e.to_string();
        assert!(matches!(e, SqsError::NoDeadLetterQueue { .. }), "{e:?}");
        // The API and the queue setting; not sqs_worker's `--dead-letter-queue` (issue #30 item 14).
        for want in ["SqsConfig::dead_letter(DeadLetterTarget::Queue(url))", "RedrivePolicy"] {
            assert!(text.contains(want), "{text:?} should name {want:?}");
        }
        assert!(!text.contains("dead_letter_queue)"), "names an API that does not exist: {text}");
        let e = Source::dead_letter(&source, d.clone(), &reason).await.expect_err("no dead-letter queue");
        assert!(e.to_string().contains("SqsConfig::dead_letter(DeadLetterTarget::Queue(url))"), "{e}");

        // With a dead-letter queue named in the config: moved once, with its reason.
        let dlq = TestQueue::new(&client, "nodlq-target", 3).await;
        let q2 = TestQueue::new(&client, "withdlq", 3).await;
        send(&client, &q2.url, "still not json {").await;
        let source = SqsSource::new(
            client.clone(),
            SqsConfig::new(&q2.url)
                .expect("url")
                .key(KeyStrategy::body_field("id"))
                .wait_time(Duration::from_secs(1))
                .dead_letter(DeadLetterTarget::Queue(dlq.url.clone())),
        );
        let (d, reason) = match receive_one(&source, secs(3), Duration::from_secs(10)).await {
            Incoming::Malformed { delivery, reason } => (delivery, reason),
            other => panic!("{other:?}"),
        };
        Source::dead_letter(&source, d, &reason).await.expect("moved");
        let moved = drain(&client, &dlq.url, 2, Duration::from_secs(4)).await;
        assert_eq!(moved.len(), 1, "moved once: {moved:?}");
        let r = moved[0].message_attributes().and_then(|a| a.get(REASON_ATTRIBUTE)).and_then(|v| v.string_value());
        assert!(r.is_some_and(|r| r.contains("not JSON")), "{r:?}");
        assert_eq!(depth(&client, &q2.url).await, 0);
        for q in [q, dlq, q2] {
            q.delete(&client).await;
        }
        drop_schema(&fence).await;
    }

    /// §4 bullet 1: FIFO group order with the head Busy. Another owner holds the head's job
    /// lease in the database (a paused holder: it never heartbeats nor commits), so the worker
    /// hides the head for the holder's time left. Then the broker hands out later messages of
    /// the group while the head is in flight, as the chaos run's LocalStack did: the test makes
    /// the followers visible again with the receipt handles a proxy between the worker and
    /// LocalStack saw (this LocalStack does hand out a group's later messages once they are
    /// visible, though an earlier one is in flight). Guard: no follower starts (or commits)
    /// before the head has committed, and the group commits in sequence order, whatever the
    /// broker hands out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_fifo_followers_wait_for_a_busy_head() {
        init_tracing();
        let client = sqs().await;
        let fence = pg().await;
        let q = TestQueue::fifo(&client, "order", 3).await;
        let keys: Vec<String> = (0..4).map(|i| format!("g-{i}")).collect();
        let entries = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                SendMessageBatchRequestEntry::builder()
                    .id(format!("e{i}"))
                    .message_body(k)
                    .message_group_id("g")
                    .message_deduplication_id(k)
                    .build()
                    .expect("entry")
            })
            .collect::<Vec<_>>();
        let sent = client.send_message_batch().queue_url(&q.url).set_entries(Some(entries)).send().await.expect("send");
        let id_of = |entry: &str| {
            sent.successful().iter().find(|e| e.id() == entry).map(|e| e.message_id().to_owned()).expect("sent")
        };
        let head_id = id_of("e0");
        let follower_ids: Vec<String> = (1..4).map(|i| id_of(&format!("e{i}"))).collect();
        // The paused holder of the head: 8 s, well beyond the followers' 3 s visibility.
        let head = JobKey::new("g-0").expect("key");
        let _ = claim(&fence, &q.name, &head, "paused-holder", 8).await;

        let log: Arc<Mutex<Vec<(String, &'static str)>>> = Arc::default();
        let l = Arc::clone(&log);
        let handler = move |ctx: JobContext| {
            let l = Arc::clone(&l);
            async move {
                l.lock().expect("lock").push((ctx.key().to_string(), "start"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                l.lock().expect("lock").push((ctx.key().to_string(), "end"));
                Ok::<_, JobError>(Vec::new())
            }
        };
        let config = SqsConfig::new(&q.url).expect("url").wait_time(Duration::from_secs(1));
        let proxy = SqsProxy::start("W", ProxyLog::default()).await;
        let consumer = Arc::new(Consumer::with_owner(
            SqsSource::new(proxy.client().await, config),
            dyn_store(&fence),
            Owner::new("fifo-worker").expect("owner"),
            ConsumerConfig::new(SupervisorConfig::new(secs(3))).concurrency(4).grace(Duration::from_secs(2)),
        ));
        let stop = CancellationToken::new();
        let (c, s) = (Arc::clone(&consumer), stop.clone());
        let task = tokio::spawn(async move { c.run(handler, s).await });
        // The worker hides the busy head (a visibility change with the head's handle) ...
        let handles_of = |log: &[ProxyEvent], id: &str| -> Vec<String> {
            log.iter()
                .filter_map(|e| match e {
                    ProxyEvent::Received { message_id, handle, .. } if message_id == id => Some(handle.clone()),
                    _ => None,
                })
                .collect()
        };
        eventually(Duration::from_secs(15), "the busy head hidden", || {
            let log = proxy.log();
            let head_handles = handles_of(&log, &head_id);
            let hidden = log.iter().any(|e| {
                matches!(e, ProxyEvent::Used { op, handles, .. }
                    if op.starts_with("ChangeMessageVisibility") && handles.iter().any(|h| head_handles.contains(h)))
            });
            async move { hidden }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // ... and the broker hands out its followers while it is in flight.
        let seen = proxy.log();
        let mut given_back = 0;
        for id in &follower_ids {
            for h in handles_of(&seen, id) {
                if client
                    .change_message_visibility()
                    .queue_url(&q.url)
                    .receipt_handle(h)
                    .visibility_timeout(0)
                    .send()
                    .await
                    .is_ok()
                {
                    given_back += 1;
                }
            }
        }
        assert!(given_back >= 1, "the followers were received with the head: {seen:?}");
        let m = consumer.metrics();
        eventually(Duration::from_secs(40), "4 completed and acked", || {
            let s = m.snapshot();
            async move { s.completions == 4 && s.acks == 4 }
        })
        .await;
        stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), task).await.expect("consumer stops");
        let snapshot = consumer.metrics().snapshot();
        assert!(snapshot.busy >= 1, "the head was busy at first: {snapshot}");
        let log = log.lock().expect("lock").clone();
        let want: Vec<(String, &str)> = keys.iter().flat_map(|k| [(k.clone(), "start"), (k.clone(), "end")]).collect();
        assert_eq!(log, want, "the group ran in order, one at a time, the head first");
        let rows = jobs(&fence).await;
        assert_eq!(rows[0].0, "g-0");
        assert_eq!((rows[0].1.as_str(), rows[0].2), ("completed", 2), "the head was taken over: {rows:?}");
        assert_eq!(depth(&client, &q.url).await, 0);
        q.delete(&client).await;
        drop_schema(&fence).await;
    }

    /// §4 bullet 2: stale receipt handles, counted the way a proxy between the workers and
    /// LocalStack sees them. Worker A receives a message, commits its job, and freezes before its
    /// delete (and before a visibility extension a heartbeat had confirmed); its visibility runs
    /// out, worker B receives the message. When A wakes, its delete, extension, hold and give-back
    /// must not go out with its old handle. Guard: after another worker's receive of a message,
    /// this worker never uses an older handle of it (the README's "a stale handle is never used
    /// to delete or extend").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_stale_handles_are_never_used() {
        init_tracing();
        let client = sqs().await;
        let fence = pg().await;
        let q = TestQueue::new(&client, "stale", 3).await;
        let log = ProxyLog::default();
        let (pa, pb) = (SqsProxy::start("A", Arc::clone(&log)).await, SqsProxy::start("B", Arc::clone(&log)).await);
        send(&client, &q.url, "job").await;
        let config = SqsConfig::new(&q.url).expect("url").wait_time(Duration::from_secs(1));
        let a = SqsSource::new(pa.client().await, config.clone());
        let b = SqsSource::new(pb.client().await, config);

        let (da, key) = unclaimed(receive_one(&a, secs(3), Duration::from_secs(10)).await);
        let lease = claimed(&fence, &q.name, &key, "A", 3).await;
        // While the handle is A's, A uses it (the proxy sees it: the count below is not blind).
        a.extend_visibility(&[(lease.clone(), da.clone())]).await.expect("extend");
        fence.complete(&lease, b"done").await.expect("commit");
        // A freezes here. Its visibility runs out; B receives the message and finds it done.
        let (db, _) = unclaimed(receive_one(&b, secs(3), Duration::from_secs(15)).await);
        assert!(matches!(claim(&fence, &q.name, &key, "B", 3).await, Claim::Done { .. }));
        // A wakes up: the delete of its commit, the extension its last heartbeat confirmed, a
        // hold and a give-back.
        let _ = a.delete(std::slice::from_ref(&da)).await;
        let _ = a.extend_visibility(&[(lease.clone(), da.clone())]).await;
        let _ = Source::hold(&a, da.clone(), Duration::from_secs(5)).await;
        let _ = Source::abandon(&a, da.clone()).await;
        drop(da);
        // B acknowledges the duplicate with its own handle.
        b.delete(std::slice::from_ref(&db)).await.expect("B deletes");
        drop(db);

        let seen = log.lock().expect("log").clone();
        let unreadable: Vec<_> = seen.iter().filter(|e| matches!(e, ProxyEvent::Unreadable { .. })).collect();
        assert!(unreadable.is_empty(), "the proxy could not read: {unreadable:?}");
        let received = |tag: &str| seen.iter().any(|e| matches!(e, ProxyEvent::Received { tag: t, .. } if t == tag));
        assert!(received("A") && received("B"), "both receives seen: {seen:?}");
        let used_by = |tag: &str| seen.iter().any(|e| matches!(e, ProxyEvent::Used { tag: t, .. } if t == tag));
        assert!(used_by("A") && used_by("B"), "both workers' calls seen: {seen:?}");
        let stale = stale_handle_uses(&seen);
        assert!(stale.is_empty(), "stale handles used (worker, call, message): {stale:?}\n{seen:#?}");
        assert_eq!(depth(&client, &q.url).await, 0, "deleted by B");
        q.delete(&client).await;
        drop_schema(&fence).await;
    }

    /// §4 bullet 2, the other side of the stale-handle guard: a message handed out late in a long
    /// poll starts its visibility when SQS hands it out, not when the poll was sent, so its handle
    /// is still ours right after the receive. Guard: the stale-handle check does not skip the
    /// delete (or extension) of a message received mid-poll.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_handle_of_a_long_poll_is_ours() {
        init_tracing();
        let client = sqs().await;
        let q = TestQueue::new(&client, "longpoll", 30).await;
        let config = SqsConfig::new(&q.url).expect("url").wait_time(Duration::from_secs(8));
        let source = SqsSource::new(client.clone(), config);
        let s = source.clone();
        let poll = tokio::spawn(async move { receive_one(&s, secs(3), Duration::from_secs(20)).await });
        // 4 s into the poll: later than the 3 s visibility counted from its start.
        tokio::time::sleep(Duration::from_secs(4)).await;
        send(&client, &q.url, "late").await;
        let (d, _) = unclaimed(poll.await.expect("poll"));
        source.delete(std::slice::from_ref(&d)).await.expect("delete");
        assert_eq!(depth(&client, &q.url).await, 0, "the delete went out with the fresh handle");
        q.delete(&client).await;
    }

    /// §4 bullet 3: `SqsRetrofit`'s heartbeat hook extends the message of the lease it
    /// confirmed. Two messages carry one attribute key; while the first runs, the second's claim
    /// is slow (a trigger in this test's schema delays it), so both are in the retrofit at once.
    /// Guard: the running message's visibility keeps following its lease (it never becomes
    /// visible while its attempt runs).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_retrofit_extends_the_message_of_its_own_lease() {
        init_tracing();
        let client = sqs().await;
        let fence = pg().await;
        let s = fence.get_schema().as_str().to_owned();
        for stmt in [
            format!("CREATE TABLE {s}.slow_claims (key text PRIMARY KEY)"),
            format!(
                "CREATE FUNCTION {s}.slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                 IF EXISTS (SELECT 1 FROM {s}.slow_claims c WHERE c.key = NEW.key) THEN PERFORM pg_sleep(4.5); END IF; \
                 RETURN NEW; END $$"
            ),
            format!(
                "CREATE TRIGGER slow_claim BEFORE INSERT ON {s}.jobs FOR EACH ROW EXECUTE FUNCTION {s}.slow_claim()"
            ),
        ] {
            sqlx::query(AssertSqlSafe(stmt)).execute(fence.pool()).await.expect("slow-claim trigger");
        }
        let q = TestQueue::new(&client, "rkey", 3).await;
        let attr = MessageAttributeValue::builder().data_type("String").string_value("order-7").build().expect("attr");
        for body in ["first", "second"] {
            client
                .send_message()
                .queue_url(&q.url)
                .message_body(body)
                .message_attributes("order-id", attr.clone())
                .send()
                .await
                .expect("send");
        }
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while got.len() < 2 && tokio::time::Instant::now() < deadline {
            got.extend(receive_raw(&client, &q.url, 1).await);
        }
        assert_eq!(got.len(), 2);
        got.sort_by_key(|m| m.body().map(str::to_owned));
        let (first, second) = (got[0].clone(), got[1].clone());
        assert_eq!(first.body(), Some("first"));
        let first_id = first.message_id().expect("id").to_owned();

        let retro = SqsRetrofit::new(
            dyn_store(&fence),
            SqsSource::new(
                client.clone(),
                SqsConfig::new(&q.url).expect("url").key(KeyStrategy::attribute("order-id")),
            ),
            SupervisorConfig::new(secs(3)),
        );
        let release = CancellationToken::new();
        let (r1, rel) = (retro.clone(), release.clone());
        let t1 = tokio::spawn(async move {
            r1.process(&first, move |ctx: JobContext| {
                let rel = rel.clone();
                async move {
                    let _ = tokio::time::timeout(Duration::from_secs(20), rel.cancelled()).await;
                    Ok::<_, JobError>(ctx.payload().to_vec())
                }
            })
            .await
        });
        let fq = q.fence_queue();
        eventually(Duration::from_secs(10), "the first message's job running", || {
            let (fence, fq) = (fence.clone(), fq.clone());
            async move { job(&fence, &fq, "order-7").await.is_some_and(|j| j.state == JobState::Running) }
        })
        .await;
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {s}.slow_claims VALUES ('order-7')")))
            .execute(fence.pool())
            .await
            .expect("slow claims on");
        let r2 = retro.clone();
        let t2 = tokio::spawn(async move {
            r2.process(&second, |_ctx: JobContext| async move { Ok::<_, JobError>(Vec::new()) }).await
        });
        // While the second claim is slow (4.5 s, longer than the 3 s visibility), watch the queue:
        // the first message must stay hidden, its visibility following its lease.
        let mut seen_first = 0;
        let watch_until = tokio::time::Instant::now() + Duration::from_millis(5000);
        while tokio::time::Instant::now() < watch_until {
            let out = client
                .receive_message()
                .queue_url(&q.url)
                .max_number_of_messages(10)
                .visibility_timeout(0)
                .wait_time_seconds(0)
                .send()
                .await
                .expect("probe");
            seen_first += out.messages().iter().filter(|m| m.message_id() == Some(first_id.as_str())).count();
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        release.cancel();
        let out2 = t2.await.expect("second");
        let out1 = t1.await.expect("first");
        assert_eq!(seen_first, 0, "the running message became visible: its lease's extensions went elsewhere");
        assert!(out1.reason() == Reason::Committed && out1.broker_error.is_none(), "{out1:?}");
        assert!(
            matches!(out2.disposition, brokerfence::Disposition::Hold(_) | brokerfence::Disposition::Ack),
            "{out2:?}"
        );
        q.delete(&client).await;
        drop_schema(&fence).await;
    }
}
