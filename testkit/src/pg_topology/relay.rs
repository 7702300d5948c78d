//! [`Relay`]: a TCP relay on a free port whose target, and whose connections, a test controls.
//!
//! Every connection is a task that copies bytes both ways itself (no `copy_bidirectional`), and
//! watches the relay's [`State`]: a new epoch ends it (`drop_connections`, `refuse`, the end of a
//! partition), a partition stops its reads (TCP backpressure builds on both sides, as when
//! packets are dropped).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How long a relayed connection waits for its target to accept before giving up (and closing
/// the client's side).
const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// What the relay does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Forwards.
    Open,
    /// Forwards nothing; new connections hang.
    Partitioned,
    /// Closes new connections at once.
    Refused,
}

/// The relay's state, watched by every connection.
#[derive(Debug, Clone, Copy)]
struct State {
    /// Where new connections go.
    target: SocketAddr,
    /// See [`Mode`].
    mode: Mode,
    /// A connection lives while the epoch is the one it was accepted in.
    epoch: u64,
}

/// A TCP relay on 127.0.0.1 (a free port) that forwards every connection to its current target: stands in for a VIP / DNS name, or for the network between standby and primary.
pub struct Relay {
    addr: SocketAddr,
    state: watch::Sender<State>,
    accept: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Starts relaying `127.0.0.1:<a free port>` to `target` (inside a tokio runtime).
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("relay: bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("relay: local address of its listener");
        let (state, watch) = watch::channel(State { target, mode: Mode::Open, epoch: 0 });
        let accept = tokio::spawn(accept_loop(listener, watch));
        Relay { addr, state, accept }
    }

    /// Where clients connect: 127.0.0.1:[`port`](Self::port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The relay's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The target new connections go to.
    pub fn target(&self) -> SocketAddr {
        self.state.borrow().target
    }

    /// New connections go to `target` from now on; established ones are left as they are.
    pub fn point_to(&self, target: SocketAddr) {
        self.state.send_modify(|s| s.target = target);
    }

    /// Closes every established connection (both sides see the socket close / reset).
    pub fn drop_connections(&self) {
        self.state.send_modify(|s| s.epoch += 1);
    }

    /// A partition: established connections stop carrying bytes in both directions (kept open, nothing forwarded, like packets dropped), and new connections are accepted but never connected to the target (they hang). `heal()` ends it (the hung connections are then closed, so clients reconnect).
    ///
    /// "The hung connections" are all the connections the partition held: the frozen established
    /// ones and the new ones alike, so a client never receives bytes that were held back.
    pub fn partition(&self) {
        self.state.send_modify(|s| s.mode = Mode::Partitioned);
    }

    /// Ends a partition (closing every connection it held) or a refusal: new connections are forwarded again.
    pub fn heal(&self) {
        self.state.send_modify(|s| {
            if s.mode == Mode::Partitioned {
                s.epoch += 1;
            }
            s.mode = Mode::Open;
        });
    }

    /// Refuse: new connections are closed right away (connection reset/EOF) and established ones closed; `heal()` ends it.
    pub fn refuse(&self) {
        self.state.send_modify(|s| {
            s.mode = Mode::Refused;
            s.epoch += 1;
        });
    }
}

impl Drop for Relay {
    /// Stops the listener; dropping the state's sender ends every connection task.
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Accepts clients until the relay is dropped: refused ones are closed at once, the others get a
/// task each.
async fn accept_loop(listener: TcpListener, watch: watch::Receiver<State>) {
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            // Out of file descriptors and the like: try again shortly.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let state = *watch.borrow();
        if state.mode == Mode::Refused {
            drop(client);
            continue;
        }
        tokio::spawn(serve(client, watch.clone(), state));
    }
}

/// One client, accepted in `state`: hangs while partitioned, else connects to the target and
/// relays both ways until both directions end or the connection's epoch passes.
async fn serve(client: TcpStream, mut watch: watch::Receiver<State>, state: State) {
    let epoch = state.epoch;
    if state.mode == Mode::Partitioned {
        epoch_passed(&mut watch, epoch).await;
        return;
    }
    let upstream = tokio::select! {
        connected = tokio::time::timeout(CONNECT_LIMIT, TcpStream::connect(state.target)) => match connected {
            Ok(Ok(upstream)) => upstream,
            _ => return,
        },
        () = epoch_passed(&mut watch, epoch) => return,
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let up = pump(client_read, upstream_write, watch.clone(), epoch);
    let down = pump(upstream_read, client_write, watch, epoch);
    tokio::pin!(up, down);
    let (mut up_done, mut down_done) = (false, false);
    while !(up_done && down_done) {
        tokio::select! {
            clean = &mut up, if !up_done => if clean { up_done = true } else { return },
            clean = &mut down, if !down_done => if clean { down_done = true } else { return },
        }
    }
}

/// Returns once the epoch is no longer `epoch` (or the relay is gone).
async fn epoch_passed(watch: &mut watch::Receiver<State>, epoch: u64) {
    loop {
        if watch.borrow_and_update().epoch != epoch {
            return;
        }
        if watch.changed().await.is_err() {
            return;
        }
    }
}

/// Waits while the relay is partitioned: `true` when bytes may flow, `false` when the connection
/// must end (its epoch passed, or the relay is gone).
async fn flowing(watch: &mut watch::Receiver<State>, epoch: u64) -> bool {
    loop {
        let state = *watch.borrow_and_update();
        if state.epoch != epoch {
            return false;
        }
        if state.mode != Mode::Partitioned {
            return true;
        }
        if watch.changed().await.is_err() {
            return false;
        }
    }
}

/// Copies `from` to `to`: `true` after passing an EOF on (a half-close), `false` when the
/// connection must end (an error, its epoch passed, the relay gone). Reads nothing while
/// partitioned; a read or write waiting on a socket gives way to every state change.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut watch: watch::Receiver<State>, epoch: u64) -> bool {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !flowing(&mut watch, epoch).await {
            return false;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) => {
                    let _ = to.shutdown().await;
                    return true;
                }
                Ok(n) => n,
                Err(_) => return false,
            },
            changed = watch.changed() => {
                if changed.is_err() {
                    return false;
                }
                continue;
            }
        };
        let mut sent = 0;
        while sent < n {
            if !flowing(&mut watch, epoch).await {
                return false;
            }
            tokio::select! {
                written = to.write(&buf[sent..n]) => match written {
                    Ok(0) | Err(_) => return false,
                    Ok(k) => sent += k,
                },
                changed = watch.changed() => if changed.is_err() {
                    return false;
                },
            }
        }
    }
}
