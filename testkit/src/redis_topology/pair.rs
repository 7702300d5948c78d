//! [`RedisPair`]: a primary and a replica whose replication runs through a [`Relay`], with a
//! second relay in front of the primary for the clients (a VIP or DNS name).

use std::time::Duration;

use super::node::{Launch, RedisNode};
use super::sys::TempRoot;
use crate::pg_topology::Relay;

/// How long [`RedisPair::wait_streaming`] waits.
const STREAMING_LIMIT: Duration = Duration::from_secs(30);

/// How long [`RedisPair::wait_caught_up`] waits.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(30);

/// How long [`RedisPair::promote_replica`] waits for `ROLE` to say `master`.
const PROMOTE_LIMIT: Duration = Duration::from_secs(10);

/// A primary and a replica that replicates through `link` (cut it to cut replication), and `vip`,
/// the relay clients connect to ([`client_url`](Self::client_url)), in front of the primary until
/// [`repoint_clients_to_replica`](Self::repoint_clients_to_replica). For "the replica was promoted
/// after its link was cut while writers kept writing to the old primary".
pub struct RedisPair {
    /// The primary (its name `primary`).
    pub primary: RedisNode,
    /// The replica (its name `replica`): `--replicaof 127.0.0.1 <link port>`.
    pub replica: RedisNode,
    /// The relay the replica replicates through, forwarding to the primary.
    pub link: Relay,
    /// The relay clients use, forwarding to the primary (then to the replica once re-pointed).
    pub vip: Relay,
}

impl RedisPair {
    /// The primary, the link relay in front of it, the replica replicating through the link, and
    /// the client relay; returns once the replica's link is up.
    pub async fn start() -> RedisPair {
        let root = TempRoot::new();
        let primary = RedisNode::start_in(root.clone(), "primary", Launch::default()).await;
        let link = Relay::start(primary.addr()).await;
        let replicaof = ["--replicaof".to_owned(), "127.0.0.1".to_owned(), link.port().to_string()];
        let replica =
            RedisNode::start_in(root, "replica", Launch { args: replicaof.to_vec(), ..Launch::default() }).await;
        let vip = Relay::start(primary.addr()).await;
        let pair = RedisPair { primary, replica, link, vip };
        pair.wait_streaming().await;
        pair
    }

    /// `redis://127.0.0.1:<vip port>`: where clients connect.
    pub fn client_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.vip.port())
    }

    /// Waits (up to 30 s) until the replica says `master_link_status:up` and the primary counts a
    /// connected replica: after `start`, or after the link heals.
    pub async fn wait_streaming(&self) {
        let check = || async {
            let replica = self.replica.try_cmd::<String>(&["INFO", "replication"]).await.ok()?;
            let primary = self.primary.try_cmd::<String>(&["INFO", "replication"]).await.ok()?;
            let up = replica.lines().any(|l| l.trim() == "master_link_status:up");
            let counted = primary.lines().any(|l| l.trim().strip_prefix("connected_slaves:").is_some_and(|n| n != "0"));
            (up && counted).then_some(())
        };
        let failure = || {
            format!(
                "redis_topology: the replica's link is not up within {STREAMING_LIMIT:?}\n{}\n{}",
                self.primary.log_tail(),
                self.replica.log_tail()
            )
        };
        crate::wait::until(STREAMING_LIMIT, check, failure).await;
    }

    /// Waits (up to 30 s) until the replica's `master_repl_offset` equals the primary's: it has
    /// everything written so far.
    pub async fn wait_caught_up(&self) {
        let check = || async {
            let primary = repl_offset(&self.primary).await?;
            (repl_offset(&self.replica).await? == primary).then_some(())
        };
        let failure = || {
            format!(
                "redis_topology: the replica has not caught up with the primary within {CATCH_UP_LIMIT:?}\n{}\n{}",
                self.primary.log_tail(),
                self.replica.log_tail()
            )
        };
        crate::wait::until(CATCH_UP_LIMIT, check, failure).await;
    }

    /// A partition of the replication link ([`Relay::partition`]): the replica gets nothing more,
    /// and neither side sees the connection close.
    pub fn cut_link(&self) {
        self.link.partition();
    }

    /// Ends the partition of the link ([`Relay::heal`]); the replica reconnects.
    pub fn heal_link(&self) {
        self.link.heal();
    }

    /// Crash the primary (SIGKILL).
    pub async fn kill_primary(&self) {
        self.primary.kill().await;
    }

    /// `REPLICAOF NO ONE` on the replica, then waits until its `ROLE` is `master`.
    pub async fn promote_replica(&self) {
        let _: String = self.replica.cmd(&["REPLICAOF", "NO", "ONE"]).await;
        let check = || async { (self.replica.try_role().await.ok()? == "master").then_some(()) };
        let failure = || {
            format!(
                "redis_topology: the replica is not a master {PROMOTE_LIMIT:?} after REPLICAOF NO ONE\n{}",
                self.replica.log_tail()
            )
        };
        crate::wait::until(PROMOTE_LIMIT, check, failure).await;
    }

    /// The VIP moves: new client connections go to the replica, and the established ones are closed.
    pub fn repoint_clients_to_replica(&self) {
        self.vip.point_to(self.replica.addr());
        self.vip.drop_connections();
    }
}

/// The `master_repl_offset` of `node`'s `INFO replication`, if it answers.
async fn repl_offset(node: &RedisNode) -> Option<u64> {
    let info: String = node.try_cmd(&["INFO", "replication"]).await.ok()?;
    info.lines().find_map(|l| l.trim().strip_prefix("master_repl_offset:")?.parse().ok())
}
