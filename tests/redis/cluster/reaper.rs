//! A defect the cluster tests found (issue #31), not a cluster one: two `ReliableList` reapers
//! could put one orphaned item back twice. A reaper remembers suspects by value; worker B's
//! reaper put the orphan back, a worker took it again and had not reserved its lease key yet, and
//! worker A's reaper, which had seen the value keyless on its previous pass, put this new copy
//! back too: a second delivery (answered by the fence, but run past its lease key and leaving a
//! stale reservation). The reapers now share a count of put-backs (`{list}:reaped`): a suspect
//! goes back only when no reaper put anything back since the pass that saw it.

use brokerfence::redis::client;
use brokerfence::redis::{ItemKey, ReliableList};
use brokerfence::{Incoming, ReceiveContext, Source};
use brokerfence::{Owner, QueueName};
use brokerfence_testkit::redis::{Env, lease};

async fn llen(env: &Env, key: &str) -> i64 {
    client::cmd("LLEN").arg(key).query_async(&mut env.conn()).await.expect("LLEN")
}

/// A worker takes the next item of `list` (`LMOVE` to `processing`); its lease key is not
/// reserved yet.
async fn take_again(env: &Env, list: &str, processing: &str) {
    let _: Option<Vec<u8>> = client::cmd("LMOVE")
        .arg(list)
        .arg(processing)
        .arg("RIGHT")
        .arg("LEFT")
        .query_async(&mut env.conn())
        .await
        .expect("LMOVE");
}

/// Guard: the reap count. Deterministic: the passes of two reapers and a worker's take are made
/// by hand, in the order that put the item back twice before the fix.
#[tokio::test]
async fn cluster_found_two_reapers_put_an_orphan_back_once() {
    let env = Env::new().await;
    let list = env.name("mail");
    let queue = QueueName::new("mail").expect("queue");
    let reaper = |_: &str| ReliableList::new(env.redis.clone(), queue.clone(), list.as_str(), ItemKey::Split(b'|'));
    let (a, b) = (reaper("a").expect("source a"), reaper("b").expect("source b"));
    let processing = a.get_processing().to_owned();
    // A worker took the item and died before reserving its lease key: an orphan.
    let _: i64 =
        client::cmd("LPUSH").arg(&processing).arg("k1|body").query_async(&mut env.conn()).await.expect("LPUSH");

    assert_eq!(a.reap().await.expect("reap"), 0, "A's first pass only suspects it");
    assert_eq!(b.reap().await.expect("reap"), 0, "B's first pass only suspects it");
    assert_eq!(b.reap().await.expect("reap"), 1, "B's second pass puts the orphan back");
    assert_eq!((llen(&env, &list).await, llen(&env, &processing).await), (1, 0));

    // Another worker takes it again; its lease key is not reserved yet.
    take_again(&env, &list, &processing).await;
    assert_eq!(a.reap().await.expect("reap"), 0, "A saw the value keyless before, but this is another copy");
    assert_eq!(
        (llen(&env, &list).await, llen(&env, &processing).await),
        (0, 1),
        "the item was put back a second time: it would be delivered twice"
    );

    // Had that worker died too, the item still goes back: A's next pass finds it keyless again,
    // with no put-back in between.
    assert_eq!(a.reap().await.expect("reap"), 1);
    assert_eq!((llen(&env, &list).await, llen(&env, &processing).await), (1, 0));
    env.cleanup().await;
}

/// The same guard for a put-back by `abandon` (a review finding): a worker whose reservation had
/// not landed gives its item back while a reaper suspects it, another worker takes it again, and
/// the reaper's next pass must not put that new copy back. `abandon` bumps the reap count too.
#[tokio::test]
async fn cluster_found_an_abandoned_item_is_not_put_back_again_by_a_reaper() {
    let env = Env::new().await;
    let list = env.name("mail");
    let queue = QueueName::new("mail").expect("queue");
    let source = || ReliableList::new(env.redis.clone(), queue.clone(), list.as_str(), ItemKey::Split(b'|'));
    let (a, w) = (source().expect("reaper a"), source().expect("worker w"));
    let processing = a.get_processing().to_owned();
    let _: i64 = client::cmd("LPUSH").arg(&list).arg("k2|body").query_async(&mut env.conn()).await.expect("LPUSH");
    let ctx = ReceiveContext { owner: Owner::new("w").expect("owner"), lease: lease(3), shutdown: Default::default() };
    let delivery = match w.receive(1, &ctx).await.expect("receive").pop() {
        Some(Incoming::Unclaimed { delivery, .. }) => delivery,
        other => panic!("one unclaimed delivery, got {other:?}"),
    };
    // Its reservation did not land (a Redis hiccup): the item sits keyless.
    let _: i64 = client::cmd("DEL").arg(delivery.lease_key()).query_async(&mut env.conn()).await.expect("DEL");
    assert_eq!(a.reap().await.expect("reap"), 0, "A suspects the keyless item");

    w.abandon(delivery).await.expect("abandon");
    take_again(&env, &list, &processing).await;
    assert_eq!(a.reap().await.expect("reap"), 0, "the copy taken again after the abandon is another copy");
    assert_eq!((llen(&env, &list).await, llen(&env, &processing).await), (0, 1));
    env.cleanup().await;
}
