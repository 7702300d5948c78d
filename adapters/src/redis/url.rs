//! The Redis URL forms this adapter takes, parsed before any connection is made:
//!
//! - one server: `redis://[USER:PASSWORD@]HOST:PORT[/DB]`, `rediss://…` (TLS),
//!   `redis+unix:///PATH` (also `unix://`, `valkey://`, `valkeys://`);
//! - Redis Cluster: `redis+cluster://[USER:PASSWORD@]HOST:PORT,HOST:PORT,…` (seed nodes; the rest
//!   of the cluster is found from them), `rediss+cluster://…` for TLS; only database 0;
//! - Sentinel: `redis+sentinel://[USER:PASSWORD@]HOST:PORT,HOST:PORT,…/MASTER[/DB]` (the
//!   sentinels, then the master's name), `rediss+sentinel://…` for TLS to the master and the
//!   sentinels. The credentials are the master's; the sentinels are asked without any.
//!
//! A port left out is 6379 (26379 for a sentinel). Nothing here ever prints a password.

use super::error::RedisError;

/// Where the adapter's Redis is.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// One server: the URL as the client crate takes it.
    Single(String),
    /// A cluster: one client URL per seed node (`redis://[user:pass@]host:port[?query]`).
    Cluster(Vec<String>),
    /// A master watched by sentinels.
    Sentinel(SentinelTarget),
}

/// A master found through sentinels.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct SentinelTarget {
    /// `host:port` of each sentinel.
    pub sentinels: Vec<String>,
    /// The name the sentinels monitor the master under.
    pub master: String,
    /// `redis` or `rediss`.
    pub scheme: &'static str,
    /// `user:password` as written in the URL (percent-encoded), if any.
    pub userinfo: Option<String>,
    /// The database.
    pub db: i64,
}

// Never prints a password.
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl SentinelTarget {
    /// The client URL of the master at `addr` (`host:port`).
    pub fn master_url(&self, addr: &str) -> String {
        let auth = self.userinfo.as_deref().map(|u| format!("{u}@")).unwrap_or_default();
        format!("{}://{auth}{addr}/{}", self.scheme, self.db)
    }

    /// The client URL of a sentinel (no credentials, no database).
    pub fn sentinel_url(&self, addr: &str) -> String {
        format!("{}://{addr}", self.scheme)
    }

    /// What to name in errors: the sentinels and the master's name.
    pub fn describe(&self) -> String {
        format!("master {:?} through sentinels {}", self.master, self.sentinels.join(","))
    }
}

impl Target {
    /// Parses `url`; a form it does not know, or a malformed one, is a typed error.
    pub fn parse(url: &str) -> Result<Target, RedisError> {
        let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        match scheme.as_deref() {
            Some("redis+cluster" | "rediss+cluster") => Self::cluster(url),
            Some("redis+sentinel" | "rediss+sentinel") => Self::sentinel(url).map(Target::Sentinel),
            Some("redis" | "rediss" | "redis+unix" | "unix" | "valkey" | "valkeys" | "valkey+unix") => {
                Ok(Target::Single(url.to_owned()))
            }
            _ => {
                let scheme = url.split_once(':').map(|(s, _)| s).filter(|s| !s.contains('/')).unwrap_or("");
                Err(RedisError::UnsupportedScheme { scheme: scheme.to_owned() })
            }
        }
    }

    /// What to name in errors (never a password).
    pub fn describe(&self) -> String {
        match self {
            Target::Single(url) => Parts::split(url).map(|p| p.hosts.to_owned()).unwrap_or_else(|_| "?".into()),
            Target::Cluster(nodes) => {
                let hosts: Vec<&str> = nodes.iter().filter_map(|n| Parts::split(n).ok().map(|p| p.hosts)).collect();
                format!("cluster seeds {}", hosts.join(","))
            }
            Target::Sentinel(s) => s.describe(),
        }
    }

    fn cluster(url: &str) -> Result<Target, RedisError> {
        let parts = Parts::split(url)?;
        let path = parts.path.trim_matches('/');
        if !(path.is_empty() || path == "0") {
            return Err(bad(format!("Redis Cluster has only database 0, the URL asks for /{path}")));
        }
        let (scheme, auth) = (parts.client_scheme(), parts.auth());
        let query = parts.query.map(|q| format!("?{q}")).unwrap_or_default();
        let nodes = hosts(parts.hosts, 6379)?;
        Ok(Target::Cluster(nodes.into_iter().map(|h| format!("{scheme}://{auth}{h}{query}")).collect()))
    }

    fn sentinel(url: &str) -> Result<SentinelTarget, RedisError> {
        let parts = Parts::split(url)?;
        if parts.query.is_some() {
            return Err(bad("a Sentinel URL takes no query (`?…`)"));
        }
        let mut path = parts.path.trim_matches('/').split('/');
        let master = path.next().filter(|m| !m.is_empty()).ok_or_else(|| {
            bad("a Sentinel URL names the master after the sentinels: redis+sentinel://HOST:PORT,…/MASTER[/DB]")
        })?;
        let db = match path.next() {
            None | Some("") => 0,
            Some(db) => db.parse::<i64>().map_err(|_| bad(format!("the database {db:?} is not a number")))?,
        };
        if path.next().is_some() {
            return Err(bad("a Sentinel URL's path is /MASTER or /MASTER/DB"));
        }
        Ok(SentinelTarget {
            sentinels: hosts(parts.hosts, 26379)?,
            master: master.to_owned(),
            scheme: parts.client_scheme(),
            userinfo: parts.auth().strip_suffix('@').map(str::to_owned),
            db,
        })
    }
}

/// `scheme://[userinfo@]hosts[/path][?query]`, split without decoding; the scheme in lower case.
struct Parts<'a> {
    scheme: String,
    userinfo: Option<&'a str>,
    hosts: &'a str,
    path: &'a str,
    query: Option<&'a str>,
}

impl<'a> Parts<'a> {
    fn split(url: &'a str) -> Result<Parts<'a>, RedisError> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no `://` after the scheme"))?;
        // The credentials end at the last `@`: a password written with an unencoded `/`, `?`, `#`
        // or `@` stays in them, so that no error below ever quotes a piece of it.
        let (userinfo, rest) = match rest.rsplit_once('@') {
            Some((u, r)) => (Some(u), r),
            None => (None, rest),
        };
        let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (hosts, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        Ok(Parts { scheme: scheme.to_ascii_lowercase(), userinfo, hosts, path, query })
    }

    /// `redis` or `rediss` (TLS), whatever the case the URL wrote it in.
    fn client_scheme(&self) -> &'static str {
        if self.scheme.starts_with("rediss") { "rediss" } else { "redis" }
    }

    /// The credentials as a client URL takes them (`user:password@`), the characters that would
    /// end them early percent-encoded; empty without credentials.
    fn auth(&self) -> String {
        let Some(userinfo) = self.userinfo else { return String::new() };
        let mut out = String::with_capacity(userinfo.len() + 1);
        for c in userinfo.chars() {
            match c {
                '/' => out.push_str("%2F"),
                '?' => out.push_str("%3F"),
                '#' => out.push_str("%23"),
                '@' => out.push_str("%40"),
                '[' => out.push_str("%5B"),
                ']' => out.push_str("%5D"),
                c => out.push(c),
            }
        }
        out.push('@');
        out
    }
}

/// `host[:port],…` → `host:port` each (IPv6 in brackets).
fn hosts(list: &str, default_port: u16) -> Result<Vec<String>, RedisError> {
    let mut out = Vec::new();
    for host in list.split(',').map(str::trim) {
        if host.is_empty() {
            return Err(bad(format!("an empty host in the host list {list:?}")));
        }
        let (name, port) = match host.rsplit_once(':') {
            Some((name, port)) if !port.contains(']') => {
                let port: u16 =
                    port.parse().map_err(|_| bad(format!("the port {port:?} of {host:?} is not a number")))?;
                (name, port)
            }
            _ => (host, default_port),
        };
        if name.is_empty() || name == "[]" {
            return Err(bad(format!("the host {host:?} has no name")));
        }
        out.push(format!("{name}:{port}"));
    }
    Ok(out)
}

fn bad(reason: impl Into<String>) -> RedisError {
    RedisError::BadUrl { reason: reason.into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_url_lists_every_seed_with_its_credentials() {
        let t = Target::parse("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002").unwrap();
        assert!(matches!(&t, Target::Cluster(n) if n == &[
            "redis://u:p%40ss@10.0.0.1:7000".to_owned(),
            "redis://u:p%40ss@10.0.0.2:6379".to_owned(),
            "redis://u:p%40ss@[::1]:7002".to_owned(),
        ]));
        assert_eq!(t.describe(), "cluster seeds 10.0.0.1:7000,10.0.0.2:6379,[::1]:7002");
        let tls = Target::parse("rediss+cluster://h:1/?protocol=resp3").unwrap();
        assert!(matches!(&tls, Target::Cluster(n) if n == &["rediss://h:1?protocol=resp3".to_owned()]));
    }

    #[test]
    fn cluster_url_refuses_another_database_and_bad_ports() {
        let e = Target::parse("redis+cluster://h:1/3").unwrap_err();
        assert!(e.to_string().contains("only database 0"), "{e}");
        let e = Target::parse("redis+cluster://h:x").unwrap_err();
        assert!(e.to_string().contains("port \"x\""), "{e}");
        let e = Target::parse("redis+cluster://h:1,,h:2").unwrap_err();
        assert!(e.to_string().contains("empty host"), "{e}");
    }

    #[test]
    fn sentinel_url_names_the_master_and_database() {
        let Target::Sentinel(s) = Target::parse("redis+sentinel://:secret@s1:5000,s2/mymaster/2").unwrap() else {
            panic!("not a sentinel target")
        };
        assert_eq!(s.sentinels, ["s1:5000", "s2:26379"]);
        assert_eq!(s.master, "mymaster");
        assert_eq!(s.db, 2);
        assert_eq!(s.master_url("10.0.0.9:6380"), "redis://:secret@10.0.0.9:6380/2");
        assert_eq!(s.sentinel_url("s1:5000"), "redis://s1:5000");
        assert!(!s.describe().contains("secret"));
    }

    #[test]
    fn sentinel_url_without_a_master_is_refused() {
        for url in [
            "redis+sentinel://s1:5000",
            "redis+sentinel://s1:5000/",
            "redis+sentinel://s1/m/x",
            "redis+sentinel://s1/m/1/2",
        ] {
            assert!(matches!(Target::parse(url), Err(RedisError::BadUrl { .. })), "{url}");
        }
    }

    /// Review finding: an upper-case `REDISS+…` scheme once built plain `redis://` client URLs.
    #[test]
    fn tls_is_kept_whatever_the_case_of_the_scheme() {
        let t = Target::parse("REDISS+CLUSTER://u:pw@h:1").unwrap();
        assert!(matches!(&t, Target::Cluster(n) if n == &["rediss://u:pw@h:1".to_owned()]), "{t:?}");
        let Target::Sentinel(s) = Target::parse("Rediss+Sentinel://:pw@s1/m").unwrap() else { panic!("sentinel") };
        assert_eq!(s.master_url("h:2"), "rediss://:pw@h:2/0");
    }

    /// Review finding: a password written with an unencoded `/`, `?` or `#` ended the credentials
    /// early, and an error quoted the rest of it.
    #[test]
    fn a_password_with_reserved_characters_stays_whole_and_unquoted() {
        let t = Target::parse("redis+cluster://u:pa/s?s#w@h:1,h:2").unwrap();
        assert!(
            matches!(&t, Target::Cluster(n) if n == &["redis://u:pa%2Fs%3Fs%23w@h:1".to_owned(), "redis://u:pa%2Fs%3Fs%23w@h:2".to_owned()]),
            "{t:?}"
        );
        for url in ["redis+cluster://u:pa/ss@h:x", "redis+cluster://u:p?ss@h:1/4", "redis+sentinel://u:p#ss@s1"] {
            let e = Target::parse(url).unwrap_err().to_string();
            assert!(!e.contains("ss"), "{url}: {e}");
        }
    }

    #[test]
    fn other_schemes_are_refused_and_single_urls_pass_through() {
        assert!(
            matches!(Target::parse("http://h:1"), Err(RedisError::UnsupportedScheme { scheme }) if scheme == "http")
        );
        assert!(matches!(Target::parse("h:6379"), Err(RedisError::UnsupportedScheme { scheme }) if scheme == "h"));
        assert!(matches!(Target::parse("redis://u:pw@h:1/2"), Ok(Target::Single(u)) if u == "redis://u:pw@h:1/2"));
        assert_eq!(Target::parse("redis://u:pw@h:1/2").unwrap().describe(), "h:1");
    }
}
