//! The HTML of the pages. Every value from the database or the request is escaped here
//! (`escape::html`, `escape::Text`), the only place text is put into markup.

use std::fmt::Write as _;

use brokerfence::QueueName;
use brokerfence::admin::{DeadJob, FenceEventKind, InFlightJob, Minute, Overview, RecordedEvent, RunningJob};

use super::App;
use super::escape::{Text, html, query_value};
use crate::output::{at, left, span};

/// The pages of the navigation: path, title.
const NAV: [(&str, &str); 4] =
    [("/", "Overview"), ("/in-flight", "In flight"), ("/fences", "Fences"), ("/dead", "Dead letters")];

/// Characters of an error or a detail shown before it is cut (the whole in its title).
const SHOWN_CHARS: usize = 200;

/// Characters of a key shown before it is cut.
const KEY_CHARS: usize = 80;

/// The page around `body`: navigation, the refresh interval for `app.js`, `<main>`.
pub(crate) fn layout(app: &App, title: &str, active: &str, body: &str) -> String {
    let mut nav = String::new();
    for (path, name) in NAV {
        let current = if path == active { " aria-current=\"page\"" } else { "" };
        let _ = write!(nav, "<a href=\"{path}\"{current}>{name}</a>");
    }
    let mode = if app.allow_write { "read-write" } else { "read-only" };
    let logout = if app.secrets.token.is_some() {
        format!(
            "<form method=\"post\" action=\"/logout\" class=\"inline\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <button type=\"submit\">Log out</button></form>",
            html(&app.secrets.csrf)
        )
    } else {
        String::new()
    };
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · brokerfence</title><link rel=\"stylesheet\" href=\"/static/app.css\">\
         <script src=\"/static/app.js\" defer></script></head>\
         <body data-refresh=\"{refresh}\"><header><strong>brokerfence</strong><nav>{nav}</nav>\
         <span class=\"mode\">{backend}, {mode} · <span id=\"refresh-state\">{live}</span></span>{logout}</header>\
         <main>{body}</main></body></html>\n",
        title = html(title),
        refresh = app.refresh.as_secs_f64(),
        backend = html(app.admin.backend()),
        live = if app.refresh.is_zero() { "no refresh" } else { "live" },
    )
}

/// A link to a job's page.
fn job_link(queue: &QueueName, key: &str) -> String {
    format!(
        "<a class=\"key\" href=\"{}\">{}</a>",
        html(&format!("/job?queue={}&key={}", query_value(queue.as_str()), query_value(key))),
        Text { text: key, max: KEY_CHARS }
    )
}

fn opt(s: &Option<String>) -> String {
    s.as_deref().map_or_else(|| "-".to_owned(), |s| Text { text: s, max: KEY_CHARS }.to_string())
}

/// A count, `10000+` when the limit was reached.
fn count(n: u64, capped: bool) -> String {
    if capped { format!("{n}+") } else { n.to_string() }
}

/// The queue filter above a list.
fn filter(path: &str, queue: Option<&QueueName>) -> String {
    format!(
        "<form method=\"get\" action=\"{path}\" class=\"filter\"><label>Queue <input name=\"queue\" value=\"{}\"></label>\
         <button type=\"submit\">Filter</button></form>",
        html(queue.map_or("", QueueName::as_str))
    )
}

/// The last minutes of a queue as a small SVG chart: claims, commits, fenced, lost per minute.
pub(crate) fn chart(minutes: &[Minute], now_ms: i64) -> String {
    const SLOTS: i64 = 30;
    let (w, h) = (300.0_f64, 60.0_f64);
    let this_minute = now_ms.div_euclid(60_000);
    let mut series = [[0u64; SLOTS as usize]; 4];
    for m in minutes {
        let ago = this_minute - m.minute.0.div_euclid(60_000);
        if (0..SLOTS).contains(&ago) {
            let slot = usize::try_from(SLOTS - 1 - ago).unwrap_or(0);
            let c = m.counts;
            for (s, v) in series.iter_mut().zip([c.claims, c.commits, c.fenced, c.lost]) {
                s[slot] = v;
            }
        }
    }
    let max = series.iter().flatten().copied().max().unwrap_or(0).max(1) as f64;
    let mut svg = format!(
        "<svg class=\"chart\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\" \
         aria-label=\"per minute, last 30 minutes\"><line class=\"axis\" x1=\"0\" y1=\"{h}\" x2=\"{w}\" y2=\"{h}\"/>"
    );
    for (class, s) in ["claims", "commits", "fenced", "lost"].iter().zip(&series) {
        let points: Vec<String> = s
            .iter()
            .enumerate()
            .map(|(i, v)| {
                format!("{:.1},{:.1}", i as f64 * w / (SLOTS - 1) as f64, h - 2.0 - (*v as f64 / max) * (h - 4.0))
            })
            .collect();
        let _ = write!(svg, "<polyline class=\"{class}\" points=\"{}\"/>", points.join(" "));
    }
    let last = |i: usize| series[i][SLOTS as usize - 1];
    let total = |i: usize| series[i].iter().sum::<u64>();
    let _ = write!(
        svg,
        "</svg><div class=\"legend\"><span class=\"claims\">claims {} ({} in 30 min)</span> \
         <span class=\"commits\">commits {} ({})</span> <span class=\"fenced\">fenced {} ({})</span> \
         <span class=\"lost\">lost {} ({})</span> <small>this minute so far; peak {max} per minute</small></div>",
        last(0),
        total(0),
        last(1),
        total(1),
        last(2),
        total(2),
        last(3),
        total(3)
    );
    svg
}

fn running_rows(queue: &QueueName, jobs: &[RunningJob]) -> String {
    let mut out = String::new();
    for r in jobs {
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"n\">{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"{}\">{}</td></tr>",
            job_link(queue, r.key.as_str()),
            r.epoch,
            opt(&r.owner),
            r.attempts,
            if r.expired() { "bad" } else { "warn" },
            html(&left(r.lease_left_ms))
        );
    }
    out
}

pub(crate) fn overview(o: &Overview) -> String {
    let mut out = format!("<h1>Overview</h1><p class=\"clock\">database clock {}</p>", html(&at(o.now)));
    if o.queues.is_empty() {
        out.push_str("<p class=\"empty\">No jobs in any queue.</p>");
        return out;
    }
    out.push_str(
        "<table class=\"queues\"><thead><tr><th>Queue</th><th>Pending</th><th>Running</th><th>Failed</th><th>Dead</th>\
         <th>Completed</th><th>Expired leases</th><th>Oldest pending</th></tr></thead><tbody>",
    );
    for q in &o.queues {
        let c = &q.counts;
        let _ = write!(
            out,
            "<tr data-queue=\"{name}\"><td>{name}</td><td class=\"n\" data-count=\"pending\">{}</td>\
             <td class=\"n\" data-count=\"running\">{}</td><td class=\"n\" data-count=\"failed\">{}</td>\
             <td class=\"n\" data-count=\"dead\">{}</td><td class=\"n\" data-count=\"completed\">{}</td>\
             <td class=\"n\">{}</td><td>{}</td></tr>",
            count(c.counts.pending, c.open_capped),
            count(c.counts.running, c.open_capped),
            count(c.counts.failed, c.open_capped),
            count(c.counts.dead, c.dead_capped),
            count(c.counts.completed, c.completed_capped),
            q.expired_leases,
            q.oldest_pending_ms.map_or_else(|| "-".to_owned(), |ms| format!("{} ago", span(ms))),
            name = html(q.queue.as_str()),
        );
    }
    let _ = write!(
        out,
        "</tbody></table><p class=\"note\">Counts read at most {} rows per queue and state group; \
         <q>+</q> means at least.</p>",
        o.count_limit
    );
    for q in &o.queues {
        let _ = write!(out, "<section class=\"queue\"><h2>{}</h2>", html(q.queue.as_str()));
        out.push_str(&chart(&q.minutes, o.now.0));
        if let Some(r) = &q.oldest_running {
            let _ = write!(
                out,
                "<p>Oldest running: {} at epoch {} by {}, due for {}, lease {}.</p>",
                job_link(&q.queue, r.key.as_str()),
                r.epoch,
                opt(&r.owner),
                html(&span(o.now.0 - r.due_since.0)),
                html(&left(r.lease_left_ms))
            );
        }
        if q.expiring.is_empty() {
            out.push_str("<p class=\"empty\">No lease about to end.</p>");
        } else {
            out.push_str(
                "<table><caption>Leases about to end</caption><thead><tr><th>Key</th><th>Epoch</th><th>Owner</th>\
                 <th>Attempt</th><th>Lease</th></tr></thead><tbody>",
            );
            out.push_str(&running_rows(&q.queue, &q.expiring));
            out.push_str("</tbody></table>");
        }
        out.push_str("</section>");
    }
    out
}

pub(crate) fn in_flight(jobs: &[InFlightJob], queue: Option<&QueueName>, limit: u32) -> String {
    let mut out = format!("<h1>In flight</h1>{}", filter("/in-flight", queue));
    if jobs.is_empty() {
        out.push_str("<p class=\"empty\">No job is running.</p>");
        return out;
    }
    let _ = write!(
        out,
        "<p class=\"note\" id=\"in-flight-count\" data-count=\"{n}\">{n} running (at most {limit} shown), soonest \
         lease end first. Lease left and last renewal are on the database clock.</p>\
         <table><thead><tr><th>Queue</th><th>Key</th><th>Epoch</th><th>Owner</th><th>Attempt</th><th>Lease left</th>\
         <th>Last renewal</th><th>Due for</th></tr></thead><tbody>",
        n = jobs.len()
    );
    for j in jobs {
        let r = &j.job;
        let now = r.lease_until.0 - r.lease_left_ms;
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"{}\">{}</td>\
             <td>{} ago</td><td>{}</td></tr>",
            html(j.queue.as_str()),
            job_link(&j.queue, r.key.as_str()),
            r.epoch,
            opt(&r.owner),
            r.attempts,
            if r.expired() {
                "bad"
            } else if r.lease_left_ms < 10_000 {
                "warn"
            } else {
                "ok"
            },
            html(&left(r.lease_left_ms)),
            html(&j.last_renewal.map_or_else(|| "not since the claim".to_owned(), |t| span(now - t.0))),
            html(&span(now - r.due_since.0)),
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub(crate) fn fences(events: &[RecordedEvent], queue: Option<&QueueName>) -> String {
    let mut out = format!(
        "<h1>Fences</h1>{}<p class=\"note\">Fenced rejections and lost leases, newest first: the loser (owner at \
         epoch) and the holder that superseded it, as the job row named it when the event was recorded.</p>",
        filter("/fences", queue)
    );
    if events.is_empty() {
        out.push_str("<p class=\"empty\">No fence event recorded.</p>");
        return out;
    }
    out.push_str(
        "<table><thead><tr><th>When</th><th>Queue</th><th>Key</th><th>What</th><th>Loser</th><th>Winner</th>\
         <th>Detail</th></tr></thead><tbody>",
    );
    for e in events {
        let what = match e.kind {
            FenceEventKind::Fenced => "fenced",
            _ => "lease lost",
        };
        let winner = match (e.winner_epoch, &e.winner_owner) {
            (Some(we), wo) if we == e.epoch && wo.as_deref() == Some(e.owner.as_str()) => {
                "not taken over yet".to_owned()
            }
            (Some(we), wo) => format!(
                "{} at epoch {we}{}",
                opt(wo),
                e.winner_state.as_deref().map_or_else(String::new, |s| format!(" ({})", html(s)))
            ),
            (None, _) => "job gone".to_owned(),
        };
        let _ = write!(
            out,
            "<tr><td title=\"{}\">{} ago</td><td>{}</td><td>{}</td><td class=\"bad\">{what}</td>\
             <td>{} at epoch {}</td><td>{winner}</td><td>{}</td></tr>",
            html(&at(e.at)),
            html(&span(e.age_ms)),
            html(e.queue.as_str()),
            job_link(&e.queue, e.key.as_str()),
            Text { text: &e.owner, max: KEY_CHARS },
            e.epoch,
            Text { text: &e.detail, max: SHOWN_CHARS },
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// A POST form of an action, with the CSRF token.
fn action(app: &App, path: &str, fields: &[(&str, &str)], label: &str, confirm: Option<&str>) -> String {
    let mut inputs = format!("<input type=\"hidden\" name=\"csrf\" value=\"{}\">", html(&app.secrets.csrf));
    for (name, value) in fields {
        let _ = write!(inputs, "<input type=\"hidden\" name=\"{}\" value=\"{}\">", html(name), html(value));
    }
    let confirm = confirm.map_or_else(String::new, |c| format!(" data-confirm=\"{}\"", html(c)));
    format!(
        "<form method=\"post\" action=\"{path}\" class=\"inline\"{confirm}>{inputs}<button type=\"submit\">{}</button></form>",
        html(label)
    )
}

pub(crate) fn dead(app: &App, dead: &[DeadJob], queue: Option<&QueueName>, actions: &[String]) -> String {
    let mut out = format!("<h1>Dead letters</h1>{}", filter("/dead", queue));
    if app.allow_write {
        let q = queue.map_or("", QueueName::as_str);
        let _ = write!(
            out,
            "<form method=\"post\" action=\"/actions/prune\" class=\"prune\" data-confirm=\"Delete finished jobs older \
             than these ages?\"><input type=\"hidden\" name=\"csrf\" value=\"{}\"><input type=\"hidden\" name=\"queue\" \
             value=\"{}\">Prune {}: completed older than <input name=\"completed_age\" value=\"15d\" size=\"5\"> dead \
             older than <input name=\"dead_age\" value=\"30d\" size=\"5\"> <button type=\"submit\">Prune</button></form>",
            html(&app.secrets.csrf),
            html(q),
            if q.is_empty() { "every queue".to_owned() } else { format!("queue {}", html(q)) },
        );
    } else {
        out.push_str("<p class=\"note\">Read-only: start with <code>--allow-write</code> to requeue and prune.</p>");
    }
    if !actions.is_empty() {
        out.push_str("<ul class=\"actions\">");
        for a in actions.iter().rev() {
            let _ = write!(out, "<li>{}</li>", Text { text: a, max: SHOWN_CHARS * 2 });
        }
        out.push_str("</ul>");
    }
    if dead.is_empty() {
        out.push_str("<p class=\"empty\" id=\"dead-count\" data-count=\"0\">No dead letters.</p>");
        return out;
    }
    let _ = write!(
        out,
        "<p class=\"note\" id=\"dead-count\" data-count=\"{n}\">{n} shown, most recent first. A requeue gives the job \
         a new epoch (its last holder stays fenced) and a full budget of attempts.</p><table><thead><tr><th>Queue</th>\
         <th>Key</th><th>Epoch</th><th>Attempts</th><th>Failures</th><th>Died</th><th>Last error</th><th></th></tr>\
         </thead><tbody>",
        n = dead.len()
    );
    for d in dead {
        let requeue = if app.allow_write {
            action(app, "/actions/requeue", &[("queue", d.queue.as_str()), ("key", d.key.as_str())], "Requeue", None)
        } else {
            String::new()
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td title=\"{}\">{} ago</td><td class=\"error\">{}</td><td>{requeue}</td></tr>",
            html(d.queue.as_str()),
            job_link(&d.queue, d.key.as_str()),
            d.epoch,
            d.attempts,
            d.failures,
            html(&at(d.died_at)),
            html(&span(d.age_ms)),
            d.last_error.as_deref().map_or_else(|| "-".to_owned(), |e| Text { text: e, max: SHOWN_CHARS }.to_string()),
        );
    }
    out.push_str("</tbody></table>");
    if let (true, Some(q)) = (app.allow_write, queue) {
        out.push_str(&action(
            app,
            "/actions/requeue",
            &[("queue", q.as_str()), ("all", "1")],
            &format!("Requeue every dead job of {}", q.as_str()),
            Some("Requeue every dead job of this queue?"),
        ));
    }
    out
}

/// A page of `title` with one line of (escaped) text.
pub(crate) fn message(title: &str, text: &str) -> String {
    format!("<h1>{}</h1><p class=\"message\">{}</p>", html(title), html(text))
}

pub(crate) fn login(failed: bool) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Log in · brokerfence</title>\
         <link rel=\"stylesheet\" href=\"/static/app.css\"></head><body><main class=\"login\"><h1>brokerfence</h1>{}\
         <form method=\"post\" action=\"/login\"><label>Token <input type=\"password\" name=\"token\" \
         autocomplete=\"current-password\" autofocus></label> <button type=\"submit\">Log in</button></form></main>\
         </body></html>\n",
        if failed { "<p class=\"bad\">Wrong token.</p>" } else { "" }
    )
}

/// One job, as `brokerfence job` shows it: its payload, progress and result escaped and cut.
pub(crate) fn job(j: &brokerfence::admin::JobInfo, bytes: [(&str, Option<&crate::shown::Shown>); 3]) -> String {
    let lease = match (j.lease_until, j.lease_left_ms) {
        (Some(until), Some(ms)) => format!("until {} ({})", at(until), left(ms)),
        _ => "-".to_owned(),
    };
    let mut rows = vec![
        ("Queue", html(j.queue.as_str())),
        ("Key", Text { text: j.key.as_str(), max: 1024 }.to_string()),
        ("State", html(j.state.as_str())),
        ("Epoch", j.epoch.to_string()),
        ("Owner", opt(&j.owner)),
        ("Attempts", format!("{} (claims)", j.attempts)),
        ("Failures", j.failures.to_string()),
        ("Lease", html(&lease)),
        ("Run at", html(&at(j.run_at))),
        (
            "Last error",
            j.last_error.as_deref().map_or_else(|| "-".to_owned(), |e| Text { text: e, max: 2000 }.to_string()),
        ),
        ("Created", html(&at(j.created_at))),
        ("Updated", format!("{} ({} ago)", html(&at(j.updated_at)), html(&span(j.now.0 - j.updated_at.0)))),
    ];
    for (name, shown) in bytes {
        rows.push((name, shown.map_or_else(|| "-".to_owned(), |s| format!("<code>{}</code>", html(&s.line())))));
    }
    let mut out = "<h1>Job</h1><table class=\"job\"><tbody>".to_owned();
    for (name, value) in rows {
        let _ = write!(out, "<tr><th>{name}</th><td>{value}</td></tr>");
    }
    out.push_str("</tbody></table>");
    out
}
