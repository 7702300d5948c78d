//! Issue #30 (see main.rs for the items of this module).

#[cfg(feature = "anyhow")]
mod anyhow_handlers {
    use std::sync::Arc;

    use anyhow::Context as _;
    use brokerfence::{
        Detail, FenceStore, Handler, JobContext, JobError, JobKey, JobResultExt, JobState, Outcome, QueueName, Retrofit,
        SupervisorConfig,
    };
    use brokerfence_testkit::store as common;

    /// What an application's own code looks like: anyhow all the way, context on the way up.
    fn load_template(path: &str) -> anyhow::Result<String> {
        std::fs::read_to_string(path).with_context(|| format!("loading the template {path}"))
    }

    /// Item 13: `?` on `anyhow::Error` in a handler compiles (feature `anyhow`) and keeps what
    /// anyhow carries: the message is the whole context chain, the error is retried, `.fatal()`
    /// on an `anyhow::Result` makes it final, and the original error stays reachable.
    ///
    /// Fix it covers: `JobError: From<E>` for every `E: Into<anyhow::Error>` with the feature on
    /// (`fence/src/job.rs`). Before it this module did not compile: "`?` couldn't convert the
    /// error to `JobError`: the trait `From<anyhow::Error>` is not implemented for `JobError`"
    /// (a plain `impl From<anyhow::Error>` conflicts with the impl for every std error, so the
    /// feature widens that impl instead).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hardening_item13_question_mark_on_anyhow_in_a_handler() {
        let store: Arc<dyn FenceStore> = Arc::new(common::sqlite().await);
        let queue = QueueName::new(common::unique("anyhow")).expect("queue");
        let retrofit = Retrofit::new(Arc::clone(&store), queue.clone(), SupervisorConfig::new(common::lease(10)));
        let missing = format!("/nonexistent/{}/template.txt", common::rand_hex());

        // `?` on anyhow::Error: a retried failure whose message is the chain.
        let key = JobKey::new("plain").expect("key");
        let path = missing.clone();
        let done = retrofit
            .process(&key, Vec::new(), |_ctx| async move {
                let template = load_template(&path)?;
                Ok(template)
            })
            .await;
        let Detail::Ran(Outcome::Failed { error, .. }) = &done.detail else {
            panic!("expected a failed attempt, got {:?}", done.detail);
        };
        assert!(error.starts_with(&format!("loading the template {missing}: No such file")), "{error}");
        let job = store.job(&queue, &key).await.expect("job").expect("row");
        assert_eq!((job.state, job.failures), (JobState::Failed, 1), "retried: {job:?}");

        // `.fatal()` on an anyhow::Result: dead at once.
        let key = JobKey::new("fatal").expect("key");
        let path = missing.clone();
        let done = retrofit
            .process(&key, Vec::new(), |_ctx| async move {
                let template = load_template(&path).fatal()?;
                Ok(template)
            })
            .await;
        assert!(matches!(&done.detail, Detail::Ran(Outcome::Dead { error }) if error.starts_with("loading the template")), "{:?}", done.detail);
        let job = store.job(&queue, &key).await.expect("job").expect("row");
        assert_eq!(job.state, JobState::Dead, "{job:?}");

        // `anyhow!` in a handler the consumer runs (the `Handler` bound). (`bail!` returns an
        // `anyhow::Error` itself, not `.into()` one: `return Err(anyhow!(…).into())` instead.)
        fn assert_handler<H: Handler>(_: H) {}
        assert_handler(|ctx: JobContext| async move {
            if ctx.payload().is_empty() {
                return Err(anyhow::anyhow!("empty payload").into());
            }
            let text = std::str::from_utf8(ctx.payload()).context("the payload is not UTF-8")?;
            Ok(text.to_uppercase())
        });

        // The conversion itself: the original error stays reachable, std errors are unchanged.
        let e = JobError::from(load_template(&missing).expect_err("missing file"));
        assert!(e.retry);
        let io = e.source().and_then(|s| s.source()).and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(io.map(std::io::Error::kind), Some(std::io::ErrorKind::NotFound), "{e:?}");
        assert_eq!(JobError::from(anyhow::anyhow!("upstream 503")).message, "upstream 503");
        let parse = "x".parse::<u32>().expect_err("not a number");
        assert_eq!(JobError::from(parse).message, "invalid digit found in string");
    }
}
