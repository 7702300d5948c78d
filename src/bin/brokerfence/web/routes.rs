//! The routes: the pages, their JSON endpoints, the actions, the login, the static files.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Form, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use brokerfence::admin::{AdminError, Requeue};
use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{JobKey, QueueName};
use serde_json::Value;

use super::{App, auth, pages, views};
use crate::shown::Shown;

type Params = Query<Vec<(String, String)>>;
type Fields = Form<Vec<(String, String)>>;

pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(overview))
        .route("/in-flight", get(in_flight))
        .route("/fences", get(fences))
        .route("/dead", get(dead))
        .route("/job", get(job))
        .route("/api/overview", get(overview_api))
        .route("/api/in-flight", get(in_flight_api))
        .route("/api/fences", get(fences_api))
        .route("/api/dead", get(dead_api))
        .route("/api/job", get(job_api))
        .route("/actions/requeue", post(requeue))
        .route("/actions/prune", post(prune))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/static/app.js", get(|| async { static_file("text/javascript; charset=utf-8", APP_JS) }))
        .route("/static/app.css", get(|| async { static_file("text/css; charset=utf-8", APP_CSS) }))
        .fallback(|| async { (StatusCode::NOT_FOUND, Html(pages::message("Not found", "No such page."))) })
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&app), auth::guard))
        .with_state(app)
}

const APP_JS: &str = include_str!("static/app.js");
const APP_CSS: &str = include_str!("static/app.css");

fn static_file(kind: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}

/// A request that cannot be served: its status and what to say.
struct Failure(StatusCode, String);

impl From<AdminError> for Failure {
    fn from(e: AdminError) -> Self {
        let status = match e {
            AdminError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            AdminError::BrokerJobs { .. } => StatusCode::CONFLICT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Failure(status, e.to_string())
    }
}

fn page(app: &App, title: &str, active: &str, result: Result<String, Failure>) -> Response {
    match result {
        Ok(body) => Html(pages::layout(app, title, active, &body)).into_response(),
        Err(Failure(status, msg)) => {
            (status, Html(pages::layout(app, title, active, &pages::message(title, &msg)))).into_response()
        }
    }
}

fn api(result: Result<Value, Failure>) -> Response {
    match result {
        Ok(v) => super::json(StatusCode::OK, &v),
        Err(Failure(status, msg)) => super::json(status, &serde_json::json!({"error": msg})),
    }
}

/// The value of `name` among `params` (the first).
fn param<'p>(params: &'p [(String, String)], name: &str) -> Option<&'p str> {
    params.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The `queue` parameter, if given and not empty.
fn queue_param(params: &[(String, String)]) -> Result<Option<QueueName>, Failure> {
    match param(params, "queue").filter(|q| !q.is_empty()) {
        None => Ok(None),
        Some(q) => QueueName::new(q).map(Some).map_err(|e| Failure(StatusCode::BAD_REQUEST, format!("queue: {e}"))),
    }
}

async fn overview_data(app: &App, params: &[(String, String)]) -> Result<brokerfence::admin::Overview, Failure> {
    Ok(app.admin.overview(queue_param(params)?.as_ref()).await?)
}

async fn overview(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let body = overview_data(&app, &p).await.map(|o| pages::overview(&o));
    page(&app, "Overview", "/", body)
}

async fn overview_api(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    api(overview_data(&app, &p).await.map(|o| views::overview_json(&o, app.admin.backend())))
}

async fn in_flight_data(app: &App, q: Option<&QueueName>) -> Result<Vec<brokerfence::admin::InFlightJob>, Failure> {
    Ok(app.admin.in_flight(q, app.list_limit).await?)
}

async fn in_flight(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let body = async {
        let q = queue_param(&p)?;
        Ok(pages::in_flight(&in_flight_data(&app, q.as_ref()).await?, q.as_ref(), app.list_limit))
    }
    .await;
    page(&app, "In flight", "/in-flight", body)
}

async fn in_flight_api(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let q = queue_param(&p);
    api(async { Ok(views::in_flight_json(&in_flight_data(&app, q?.as_ref()).await?)) }.await)
}

async fn fences(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let body = async {
        let q = queue_param(&p)?;
        Ok(pages::fences(&app.admin.fence_events(q.as_ref(), app.list_limit).await?, q.as_ref()))
    }
    .await;
    page(&app, "Fences", "/fences", body)
}

async fn fences_api(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let q = queue_param(&p);
    api(async { Ok(views::events_json(&app.admin.fence_events(q?.as_ref(), app.list_limit).await?)) }.await)
}

async fn dead(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let body = async {
        let q = queue_param(&p)?;
        let dead = app.admin.dead_letters(q.as_ref(), app.list_limit).await?;
        let actions: Vec<String> = app.actions.lock().map(|a| a.iter().cloned().collect()).unwrap_or_default();
        Ok(pages::dead(&app, &dead, q.as_ref(), &actions))
    }
    .await;
    page(&app, "Dead letters", "/dead", body)
}

async fn dead_api(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let q = queue_param(&p);
    api(async { Ok(views::dead_list_json(&app.admin.dead_letters(q?.as_ref(), app.list_limit).await?)) }.await)
}

/// One job: its summary and its row (for the bytes), as `brokerfence job` reads them.
async fn job_data(
    app: &App,
    p: &[(String, String)],
) -> Result<(brokerfence::admin::JobInfo, Option<brokerfence::JobRecord>), Failure> {
    let q = queue_param(p)?.ok_or_else(|| Failure(StatusCode::BAD_REQUEST, "no queue given".into()))?;
    let key = JobKey::new(param(p, "key").unwrap_or_default())
        .map_err(|e| Failure(StatusCode::BAD_REQUEST, format!("key: {e}")))?;
    let Some(info) = app.admin.job(&q, &key).await? else {
        return Err(Failure(StatusCode::NOT_FOUND, format!("no job {key} in queue {q}")));
    };
    let record = tokio::time::timeout(app.timeout, app.store.job(&q, &key))
        .await
        .map_err(|_| Failure(StatusCode::GATEWAY_TIMEOUT, "reading the job timed out".into()))?
        .map_err(|e| Failure(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok((info, record))
}

/// `job --json`'s document.
async fn job_api(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    api(async {
        let (info, record) = job_data(&app, &p).await?;
        Ok(crate::output::job_json(&info, &crate::output::JobBytes::new(record.as_ref(), false)))
    }
    .await)
}

async fn job(State(app): State<Arc<App>>, Query(p): Params) -> Response {
    let body = async {
        let (info, record) = job_data(&app, &p).await?;
        let shown = |b: Option<&Vec<u8>>| b.map(|b| Shown::new(b, false));
        let (payload, progress, result) = (
            shown(record.as_ref().and_then(|r| r.payload.as_ref())),
            shown(record.as_ref().and_then(|r| r.progress.as_ref())),
            shown(record.as_ref().and_then(|r| r.result.as_ref())),
        );
        Ok(pages::job(
            &info,
            [("Payload", payload.as_ref()), ("Progress", progress.as_ref()), ("Result", result.as_ref())],
        ))
    }
    .await;
    page(&app, "Job", "", body)
}

/// Refuses an action unless writes are allowed and the form carries this process's CSRF token.
fn writable(app: &App, fields: &[(String, String)]) -> Result<(), Failure> {
    if !app.allow_write {
        return Err(Failure(StatusCode::FORBIDDEN, "read-only: start `brokerfence serve` with --allow-write".into()));
    }
    match param(fields, "csrf") {
        Some(t) if auth::same(t, &app.secrets.csrf) => Ok(()),
        _ => Err(Failure(StatusCode::FORBIDDEN, "missing or wrong CSRF token: reload the page".into())),
    }
}

/// After an action: back to the dead letters (of the queue), or the failure.
fn after_action(app: &App, queue: Option<&QueueName>, result: Result<String, Failure>) -> Response {
    match result {
        Ok(done) => {
            app.note(done);
            let to = queue.map_or_else(
                || "/dead".to_owned(),
                |q| format!("/dead?queue={}", super::escape::query_value(q.as_str())),
            );
            Redirect::to(&to).into_response()
        }
        Err(Failure(status, msg)) => {
            (status, Html(pages::layout(app, "Action refused", "/dead", &pages::message("Action refused", &msg))))
                .into_response()
        }
    }
}

async fn requeue(State(app): State<Arc<App>>, Form(f): Fields) -> Response {
    let queue = queue_param(&f).ok().flatten();
    let result = async {
        writable(&app, &f)?;
        let q = queue_param(&f)?.ok_or_else(|| Failure(StatusCode::BAD_REQUEST, "no queue given".into()))?;
        let which = if param(&f, "all") == Some("1") {
            Requeue::AllDead
        } else {
            let keys: Vec<JobKey> = f
                .iter()
                .filter(|(k, _)| k == "key")
                .map(|(_, v)| JobKey::new(v.as_str()))
                .collect::<Result<_, _>>()
                .map_err(|e| Failure(StatusCode::BAD_REQUEST, format!("key: {e}")))?;
            if keys.is_empty() {
                return Err(Failure(StatusCode::BAD_REQUEST, "no key given".into()));
            }
            Requeue::Keys(keys)
        };
        let report = app.admin.requeue_dead(&q, which).await?;
        let mut done = format!("queue {q}: requeued {} dead job(s)", report.requeued.len());
        for r in report.requeued.iter().take(10) {
            done.push_str(&format!("; {} now pending at epoch {}", r.key, r.epoch));
        }
        for s in report.skipped.iter().take(10) {
            done.push_str(&format!("; {} skipped ({})", s.key, s.state.map_or("no such job", |s| s.as_str())));
        }
        Ok(done)
    }
    .await;
    after_action(&app, queue.as_ref(), result)
}

async fn prune(State(app): State<Arc<App>>, Form(f): Fields) -> Response {
    let queue = queue_param(&f).ok().flatten();
    let result = async {
        writable(&app, &f)?;
        let age = |name: &str, default: &str| {
            crate::args::age(param(&f, name).filter(|s| !s.is_empty()).unwrap_or(default))
                .map_err(|e| Failure(StatusCode::BAD_REQUEST, format!("{name}: {e}")))
        };
        let policy = QueueRetention::completed_for(age("completed_age", "15d")?).dead_for(age("dead_age", "30d")?);
        let queues = match &queue {
            Some(q) => vec![q.clone()],
            None => app.admin.queues().await?,
        };
        let mut retention = Retention::new();
        for q in &queues {
            retention = retention.queue(q.clone(), policy);
        }
        let r = app.admin.prune(&retention).await?;
        Ok(format!(
            "pruned {} completed, {} dead job(s) and {} dashboard row(s) of {} queue(s){}",
            r.completed,
            r.dead,
            r.dashboard,
            queues.len(),
            if r.contended { "; another pruner was at work, the next run carries on" } else { "" }
        ))
    }
    .await;
    after_action(&app, queue.as_ref(), result)
}

async fn login_page() -> Response {
    Html(pages::login(false)).into_response()
}

async fn login(State(app): State<Arc<App>>, Form(f): Fields) -> Response {
    match (&app.secrets.token, param(&f, "token")) {
        (None, _) => Redirect::to("/").into_response(),
        (Some(token), Some(given)) if auth::same(given, token) => {
            let session = app.secrets.open_session();
            ([(header::SET_COOKIE, auth::session_cookie(Some(&session)))], Redirect::to("/")).into_response()
        }
        _ => {
            // Slows down guessing.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            (StatusCode::UNAUTHORIZED, Html(pages::login(true))).into_response()
        }
    }
}

async fn logout(State(app): State<Arc<App>>, headers: header::HeaderMap, Form(f): Fields) -> Response {
    match param(&f, "csrf") {
        Some(t) if auth::same(t, &app.secrets.csrf) => {
            // The session ends here, not only in this browser: a copy of the cookie is refused too.
            if let Some(session) = auth::session_of(&headers) {
                app.secrets.close_session(session);
            }
            ([(header::SET_COOKIE, auth::session_cookie(None))], Redirect::to("/login")).into_response()
        }
        _ => (StatusCode::FORBIDDEN, "missing or wrong CSRF token\n").into_response(),
    }
}
