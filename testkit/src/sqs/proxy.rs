//! An HTTP proxy in front of SQS that records which receipt handles each worker was handed and
//! used (the check for stale handles), and can stall like a hung broker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::sqs::aws_config;
use brokerfence::sqs::aws_sdk_sqs::Client;
use tokio::io::{AsyncBufReadExt, BufReader};

use super::aws;

/// What an [`SqsProxy`] saw, in the order it saw it (shared by several proxies, so the order
/// across workers is the order the requests and answers passed through).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyEvent {
    /// A `ReceiveMessage` answer handed this receipt handle for this message to the worker `tag`.
    Received { tag: String, message_id: String, handle: String },
    /// The worker `tag` sent `op` (the `X-Amz-Target` operation) with these receipt handles.
    Used { tag: String, op: String, handles: Vec<String> },
    /// A request or answer the proxy could not read as JSON (the check would be blind to it).
    Unreadable { tag: String, op: String, what: String },
}

/// The shared, ordered log of one or more proxies.
pub type ProxyLog = Arc<Mutex<Vec<ProxyEvent>>>;

/// A TCP proxy on 127.0.0.1 in front of the SQS endpoint that reads each HTTP/1.1 exchange:
/// it records which receipt handles every `ReceiveMessage` answer handed out and which handles
/// every other call used (the SDK speaks the JSON protocol). [`SqsProxy::stall`] makes it stop
/// forwarding: requests are read and then held, their connections left open (a hung broker);
/// [`SqsProxy::refuse`] makes it answer one operation with a server error (a broker that fails
/// that call) while forwarding the rest.
#[derive(Clone)]
pub struct SqsProxy {
    /// `http://127.0.0.1:<port>`: the endpoint to give a client.
    pub endpoint: String,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    faults: Arc<Faults>,
    log: ProxyLog,
}

/// The operation the proxy refuses, and how many requests it refused.
#[derive(Default)]
struct Faults {
    refusing: Mutex<Option<String>>,
    refused: std::sync::atomic::AtomicUsize,
}

impl Faults {
    /// Whether to refuse a request of `op` (counted when it is).
    fn refuses(&self, op: &str) -> bool {
        let refuse = self.refusing.lock().map(|r| r.as_deref() == Some(op)).unwrap_or(false);
        if refuse {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        refuse
    }
}

impl SqsProxy {
    /// Starts a proxy for the worker `tag`, logging into `log`.
    pub async fn start(tag: &str, log: ProxyLog) -> Self {
        let upstream = aws().endpoint.split("://").nth(1).unwrap_or("127.0.0.1:4566").trim_end_matches('/').to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let faults = Arc::new(Faults::default());
        let (s, f, l, tag) = (Arc::clone(&stalled), Arc::clone(&faults), Arc::clone(&log), tag.to_owned());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (s, f, l, tag, upstream) =
                    (Arc::clone(&s), Arc::clone(&f), Arc::clone(&l), tag.clone(), upstream.clone());
                tokio::spawn(async move {
                    let _ = proxy_connection(client, &upstream, &tag, (&s, &f), &l).await;
                });
            }
        });
        Self { endpoint: format!("http://{addr}"), stalled, faults, log }
    }

    /// Stops (true) or resumes (false) forwarding.
    pub fn stall(&self, on: bool) {
        self.stalled.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Answers every request of `op` (the `X-Amz-Target` operation, e.g. `DeleteMessage`) with an
    /// HTTP 500 `InternalError` instead of forwarding it, until called with `None`: SQS failing
    /// that call (the SDK retries it, then reports the error).
    pub fn refuse(&self, op: Option<&str>) {
        if let Ok(mut r) = self.faults.refusing.lock() {
            *r = op.map(str::to_owned);
        }
    }

    /// How many requests [`refuse`](Self::refuse) answered with an error.
    pub fn refused(&self) -> usize {
        self.faults.refused.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The shared log.
    pub fn log(&self) -> Vec<ProxyEvent> {
        self.log.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// An SQS client through this proxy, configured as a user who brings their own client
    /// would (no timeouts set).
    pub async fn client(&self) -> Client {
        super::client_at(&self.endpoint).await
    }

    /// The loader [`client`](Self::client) uses, for clients with settings of their own.
    pub fn loader(&self) -> aws_config::ConfigLoader {
        super::loader_at(&self.endpoint)
    }
}

/// One HTTP/1.1 message read off a stream: the head (as sent) and the body (de-chunked), plus
/// the raw bytes to forward.
struct HttpMessage {
    head: String,
    body: Vec<u8>,
    raw: Vec<u8>,
}

impl HttpMessage {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

async fn read_http<R: tokio::io::AsyncRead + Unpin>(r: &mut BufReader<R>) -> std::io::Result<Option<HttpMessage>> {
    use tokio::io::AsyncReadExt;
    let mut raw = Vec::new();
    let mut head = String::new();
    loop {
        let mut line = String::new();
        let n = r.read_line(&mut line).await?;
        if n == 0 {
            return Ok(None);
        }
        raw.extend_from_slice(line.as_bytes());
        head.push_str(&line);
        if line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut msg = HttpMessage { head, body: Vec::new(), raw };
    if msg.header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).await?;
            msg.raw.extend_from_slice(size.as_bytes());
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).await?;
            msg.raw.extend_from_slice(&chunk);
            msg.body.extend_from_slice(&chunk[..n]);
            if n == 0 {
                break;
            }
        }
    } else if let Some(len) = msg.header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).await?;
        msg.raw.extend_from_slice(&body);
        msg.body = body;
    }
    Ok(Some(msg))
}

fn handles_in(v: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(h) = v.get("ReceiptHandle").and_then(|h| h.as_str()) {
        out.push(h.to_owned());
    }
    if let Some(entries) = v.get("Entries").and_then(|e| e.as_array()) {
        out.extend(entries.iter().filter_map(|e| e.get("ReceiptHandle").and_then(|h| h.as_str()).map(str::to_owned)));
    }
    out
}

async fn proxy_connection(
    client: tokio::net::TcpStream,
    upstream: &str,
    tag: &str,
    (stalled, faults): (&std::sync::atomic::AtomicBool, &Faults),
    log: &Mutex<Vec<ProxyEvent>>,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let up = tokio::net::TcpStream::connect(upstream).await?;
    let (cr, mut cw) = client.into_split();
    let (ur, mut uw) = up.into_split();
    let (mut cr, mut ur) = (BufReader::new(cr), BufReader::new(ur));
    let push = |e: ProxyEvent| {
        if let Ok(mut l) = log.lock() {
            l.push(e);
        }
    };
    while let Some(req) = read_http(&mut cr).await? {
        // A stalled broker: the request was read, nothing is forwarded, the connection stays open.
        while stalled.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let op = req.header("x-amz-target").unwrap_or("?").rsplit('.').next().unwrap_or("?").to_owned();
        if faults.refuses(&op) {
            let body = br#"{"__type":"InternalError","message":"refused by the test proxy"}"#;
            let head = format!(
                "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/x-amz-json-1.0\r\n\
                 x-amzn-requestid: test-proxy\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            cw.write_all(head.as_bytes()).await?;
            cw.write_all(body).await?;
            continue;
        }
        if op != "ReceiveMessage" {
            match serde_json::from_slice::<serde_json::Value>(&req.body) {
                Ok(v) => {
                    let handles = handles_in(&v);
                    if !handles.is_empty() {
                        push(ProxyEvent::Used { tag: tag.to_owned(), op: op.clone(), handles });
                    }
                }
                Err(e) if !req.body.is_empty() => {
                    push(ProxyEvent::Unreadable { tag: tag.to_owned(), op: op.clone(), what: e.to_string() })
                }
                Err(_) => {}
            }
        }
        uw.write_all(&req.raw).await?;
        let Some(resp) = read_http(&mut ur).await? else { return Ok(()) };
        if op == "ReceiveMessage" {
            match serde_json::from_slice::<serde_json::Value>(&resp.body) {
                Ok(v) => {
                    for m in v.get("Messages").and_then(|m| m.as_array()).into_iter().flatten() {
                        if let (Some(id), Some(h)) = (
                            m.get("MessageId").and_then(|x| x.as_str()),
                            m.get("ReceiptHandle").and_then(|x| x.as_str()),
                        ) {
                            push(ProxyEvent::Received {
                                tag: tag.to_owned(),
                                message_id: id.to_owned(),
                                handle: h.to_owned(),
                            });
                        }
                    }
                }
                Err(e) => push(ProxyEvent::Unreadable { tag: tag.to_owned(), op: op.clone(), what: e.to_string() }),
            }
        }
        cw.write_all(&resp.raw).await?;
    }
    Ok(())
}

/// Uses of a receipt handle older than another worker's receive of the same message, as a proxy
/// between the workers and SQS sees them: `(tag, op, message id)` for each.
pub fn stale_handle_uses(log: &[ProxyEvent]) -> Vec<(String, String, String)> {
    // handle -> (message id, index of the receive that handed it out)
    let mut handed: HashMap<String, (String, usize)> = HashMap::new();
    // message id -> receives so far: (index, tag)
    let mut receives: HashMap<String, Vec<(usize, String)>> = HashMap::new();
    let mut stale = Vec::new();
    for (i, e) in log.iter().enumerate() {
        match e {
            ProxyEvent::Received { tag, message_id, handle } => {
                handed.insert(handle.clone(), (message_id.clone(), i));
                receives.entry(message_id.clone()).or_default().push((i, tag.clone()));
            }
            ProxyEvent::Used { tag, op, handles } => {
                for h in handles {
                    let Some((mid, at)) = handed.get(h) else { continue };
                    let newer_elsewhere =
                        receives.get(mid).is_some_and(|r| r.iter().any(|(j, other)| *j > *at && other != tag));
                    if newer_elsewhere {
                        stale.push((tag.clone(), op.clone(), mid.clone()));
                    }
                }
            }
            ProxyEvent::Unreadable { .. } => {}
        }
    }
    stale
}
