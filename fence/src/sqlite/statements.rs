//! The embedded SQLite migrations and the fence statements, rendered once per schema and set of
//! guards.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

use crate::guards::Guards;
use crate::schema::{Migration, SchemaName};

/// The database clock in milliseconds.
pub(super) const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "jobs and ledger",
        statements: &[
            "CREATE TABLE {s}_jobs (
            queue       TEXT    NOT NULL,
            key         TEXT    NOT NULL,
            state       TEXT    NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'running', 'completed', 'failed', 'dead')),
            epoch       INTEGER NOT NULL DEFAULT 0 CHECK (epoch >= 0),
            owner       TEXT,
            lease_until INTEGER,
            attempts    INTEGER NOT NULL DEFAULT 0,
            run_at      INTEGER NOT NULL,
            payload     BLOB,
            progress    BLOB,
            result      BLOB,
            last_error  TEXT,
            created_at  INTEGER NOT NULL,
            updated_at  INTEGER NOT NULL,
            PRIMARY KEY (queue, key)
        )",
            "CREATE INDEX {s}_jobs_due ON {s}_jobs (queue, run_at) WHERE state IN ('pending', 'failed')",
            "CREATE INDEX {s}_jobs_leased ON {s}_jobs (queue, lease_until) WHERE state = 'running'",
            "CREATE TRIGGER {s}_jobs_epoch_never_decreases BEFORE UPDATE OF epoch ON {s}_jobs
         WHEN NEW.epoch < OLD.epoch
         BEGIN SELECT RAISE(ABORT, 'brokerfence: epoch would decrease'); END",
            "CREATE TABLE {s}_ledger (
            scope      TEXT    NOT NULL,
            job        TEXT    NOT NULL,
            epoch      INTEGER NOT NULL,
            updated_at INTEGER NOT NULL,
            PRIMARY KEY (scope, job)
        )",
        ],
    },
    Migration {
        version: 2,
        name: "failures apart from claims",
        // A constant default: SQLite only rewrites the schema text, not the rows.
        statements: &["ALTER TABLE {s}_jobs ADD COLUMN failures INTEGER NOT NULL DEFAULT 0"],
    },
    Migration {
        version: 3,
        name: "retention and epoch floors",
        // The per-queue epoch floor pruning raises (see `crate::retention`), and the indexes the
        // pruner reads: finished jobs by (queue, state, age), ledger rows by (scope, age). Index
        // builds hold the write lock while they read the table (one writer at a time anyway).
        statements: &[
            "CREATE TABLE IF NOT EXISTS {s}_epoch_floors (
            queue      TEXT    PRIMARY KEY,
            floor      INTEGER NOT NULL CHECK (floor >= 0),
            updated_at INTEGER NOT NULL
        )",
            "CREATE INDEX IF NOT EXISTS {s}_jobs_finished ON {s}_jobs (queue, state, updated_at) \
             WHERE state IN ('completed', 'dead')",
            "CREATE INDEX IF NOT EXISTS {s}_ledger_age ON {s}_ledger (scope, updated_at)",
        ],
    },
    Migration {
        version: 4,
        name: "ledger owners",
        // Who sent the newest epoch, so that an equal epoch from another owner is refused (see
        // `crate::ledger`). A nullable column: the schema text only; existing rows have no owner
        // and accept an equal epoch from anyone, as before.
        statements: &["ALTER TABLE {s}_ledger ADD COLUMN owner TEXT"],
    },
    Migration {
        version: 5,
        name: "producer trace context",
        // Issue #34: the producer's W3C trace context (feature `otel`), handed back by
        // `claim_next`. Nullable columns: the schema text only, no rewrite.
        statements: &[
            "ALTER TABLE {s}_jobs ADD COLUMN traceparent TEXT",
            "ALTER TABLE {s}_jobs ADD COLUMN tracestate TEXT",
        ],
    },
    Migration {
        version: 6,
        name: "dashboard activity and fence events",
        // PostgreSQL's migration 13 (issue #35): activity per queue and minute (minutes as
        // milliseconds since the Unix epoch), and the ring of fence events (slot = seq mod
        // `admin::FENCE_EVENT_SLOTS`).
        statements: &[
            "CREATE TABLE IF NOT EXISTS {s}_activity (
            queue   TEXT    NOT NULL,
            minute  INTEGER NOT NULL,
            claims  INTEGER NOT NULL DEFAULT 0,
            commits INTEGER NOT NULL DEFAULT 0,
            fenced  INTEGER NOT NULL DEFAULT 0,
            lost    INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (queue, minute)
        )",
            "CREATE INDEX IF NOT EXISTS {s}_activity_minute ON {s}_activity (minute)",
            "CREATE TABLE IF NOT EXISTS {s}_fence_events (
            slot         INTEGER PRIMARY KEY,
            seq          INTEGER NOT NULL,
            at           INTEGER NOT NULL,
            queue        TEXT    NOT NULL,
            key          TEXT    NOT NULL,
            kind         TEXT    NOT NULL CHECK (kind IN ('fenced', 'lease_lost')),
            detail       TEXT    NOT NULL,
            epoch        INTEGER NOT NULL,
            owner        TEXT    NOT NULL,
            winner_epoch INTEGER,
            winner_owner TEXT,
            winner_state TEXT
        )",
            "CREATE INDEX IF NOT EXISTS {s}_fence_events_seq ON {s}_fence_events (seq)",
            "CREATE INDEX IF NOT EXISTS {s}_fence_events_queue ON {s}_fence_events (queue, seq)",
            "CREATE INDEX IF NOT EXISTS {s}_fence_events_at ON {s}_fence_events (at)",
        ],
    },
];

/// The migration version this build needs: the newest embedded migration.
pub(super) const REQUIRED_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The SET list of a claim by `owner` until `lease_end`, with the cap on claims (`cap`, a
/// parameter): a claim that would exceed it makes the job dead instead (epoch and owner kept),
/// naming the cap in `last_error`. `t` is the prefix of the old row's columns. As on PostgreSQL
/// (see `postgres::capped_claim`), `updated_at` changes only when the claim makes the job dead.
fn capped_claim(t: &str, owner: &str, lease_end: &str, cap: &str, inc: &str) -> String {
    let over = format!("{t}attempts >= {cap}");
    format!(
        "state = CASE WHEN {over} THEN 'dead' ELSE 'running' END, \
         epoch = CASE WHEN {over} THEN {t}epoch ELSE {t}epoch + {inc} END, \
         owner = CASE WHEN {over} THEN {t}owner ELSE {owner} END, \
         lease_until = CASE WHEN {over} THEN NULL ELSE {lease_end} END, \
         attempts = CASE WHEN {over} THEN {t}attempts ELSE {t}attempts + 1 END, \
         last_error = CASE WHEN {over} THEN 'claimed ' || {t}attempts || \
           ' times without finishing (max_claims = ' || {cap} || ')' ELSE {t}last_error END, \
         updated_at = CASE WHEN {over} THEN {NOW} ELSE {t}updated_at END"
    )
}

#[derive(Debug)]
pub(crate) struct Statements {
    pub(super) claim: Arc<str>,
    pub(super) claim_seen: Arc<str>,
    pub(super) enqueue: Arc<str>,
    pub(super) next_due: Arc<str>,
    pub(super) claim_next: Arc<str>,
    pub(super) dead_key: Arc<str>,
    pub(super) heartbeat: Arc<str>,
    pub(super) checkpoint: Arc<str>,
    pub(super) complete: Arc<str>,
    pub(super) fail: Arc<str>,
    pub(super) release: Arc<str>,
    pub(super) current: Arc<str>,
    pub(super) job: Arc<str>,
    pub(crate) ledger_accept: Arc<str>,
    pub(crate) ledger_current: Arc<str>,
    pub(super) prune_jobs: Arc<str>,
    pub(super) raise_floor: Arc<str>,
    pub(crate) prune_ledger: Arc<str>,
}

impl Statements {
    pub(super) fn new(schema: &SchemaName, guards: Guards) -> Self {
        let s = schema.as_str();
        let inc = if guards.epoch_increment { "1" } else { "0" };
        let cas = if guards.commit_cas {
            "queue = ?1 AND key = ?2 AND owner = ?3 AND epoch = ?4 AND state = 'running'"
        } else {
            "queue = ?1 AND key = ?2"
        };
        let hb_cas = if guards.heartbeat_cas {
            "queue = ?1 AND key = ?2 AND epoch = ?3 AND owner = ?4 AND state = 'running'"
        } else {
            "queue = ?1 AND key = ?2"
        };
        // As on PostgreSQL: newer wins, an equal epoch from another named owner is refused.
        let ledger_where = match (guards.ledger_check, guards.ledger_owner_check) {
            (false, _) => "",
            (true, false) => "WHERE epoch <= excluded.epoch",
            (true, true) => {
                "WHERE epoch < excluded.epoch OR (epoch = excluded.epoch \
                 AND (owner IS NULL OR excluded.owner IS NULL OR owner = excluded.owner))"
            }
        };
        // The queue's epoch floor (0 without a row): one primary-key probe.
        let floor = format!("coalesce((SELECT f.floor FROM {s}_epoch_floors f WHERE f.queue = ?1), 0)");
        let claim = format!(
            "INSERT INTO {s}_jobs AS t (queue, key, state, epoch, owner, lease_until, attempts, run_at, created_at, updated_at) \
             VALUES (?1, ?2, 'running', {floor} + 1, ?3, {NOW} + ?4, 1, {NOW}, {NOW}, {NOW}) \
             ON CONFLICT (queue, key) DO UPDATE SET {capped} \
             WHERE t.state = 'pending' OR (t.state = 'failed' AND t.run_at <= {NOW}) \
                OR (t.state = 'running' AND t.lease_until < {NOW}) \
             RETURNING key, CASE WHEN state = 'dead' THEN 'dead' ELSE 'claimed' END, epoch, owner, lease_until, \
               lease_until - {NOW}, attempts, run_at - {NOW}",
            capped = capped_claim("t.", "excluded.owner", "excluded.lease_until", "?5", inc),
        );
        // SQLite has one writer at a time: the floor read here and the pruner's delete never
        // interleave (both run in `BEGIN IMMEDIATE` transactions).
        let claim_seen = format!(
            "SELECT key, state, epoch, owner, lease_until, lease_until - {NOW}, attempts, run_at - {NOW} \
             FROM {s}_jobs WHERE queue = ?1 AND key = ?2"
        );
        // When the earliest job of a queue waiting to become due is due ($1 queue), in ms from
        // now, by the `jobs_due` index.
        let next_due = format!(
            "SELECT run_at - {NOW} FROM {s}_jobs WHERE queue = ?1 AND state IN ('pending', 'failed') \
             AND run_at > {NOW} ORDER BY run_at LIMIT 1"
        );
        let enqueue = format!(
            "INSERT INTO {s}_jobs (queue, key, state, epoch, payload, run_at, created_at, updated_at, traceparent, tracestate) \
             VALUES (?1, ?2, 'pending', {floor}, ?3, {NOW}, {NOW}, {NOW}, ?4, ?5) ON CONFLICT (queue, key) DO NOTHING"
        );
        let claim_next = format!(
            "UPDATE {s}_jobs SET {capped} \
             WHERE rowid IN (SELECT rowid FROM {s}_jobs WHERE queue = ?1 AND \
               ((state IN ('pending', 'failed') AND run_at <= {NOW}) OR (state = 'running' AND lease_until < {NOW})) \
               ORDER BY state = 'running' DESC, run_at LIMIT ?4) \
             RETURNING rowid, CAST(key AS BLOB), state, epoch, lease_until, lease_until - {NOW}, attempts, payload, progress, \
               substr(CAST(traceparent AS BLOB), 1, 64), substr(CAST(tracestate AS BLOB), 1, 513)",
            capped = capped_claim("", "?2", &format!("{NOW} + ?3"), "?5", inc),
        );
        // A row `claim_next` took (by rowid, ?1) whose key `JobKey` refuses (issue #30): dead
        // under the claim's lease (?3 owner, ?4 epoch), with the reason (?2). By rowid, as such
        // a key may not even be text.
        let dead_key = format!(
            "UPDATE {s}_jobs SET state = 'dead', last_error = ?2, lease_until = NULL, updated_at = {NOW} \
             WHERE rowid = ?1 AND owner = ?3 AND epoch = ?4 AND state = 'running'"
        );
        let heartbeat = format!(
            "UPDATE {s}_jobs SET lease_until = {NOW} + ?5, updated_at = {NOW} WHERE {hb_cas} \
             RETURNING queue, key, {epoch}, {owner}, lease_until, lease_until - {NOW}",
            epoch = if guards.heartbeat_cas { "epoch" } else { "?3" },
            owner = if guards.heartbeat_cas { "owner" } else { "?4" }
        );
        let checkpoint = format!("UPDATE {s}_jobs SET progress = ?5, updated_at = {NOW} WHERE {cas} RETURNING ''");
        let complete = format!(
            "UPDATE {s}_jobs SET state = 'completed', result = ?5, lease_until = NULL, updated_at = {NOW} \
             WHERE {cas} RETURNING ''"
        );
        let fail = format!(
            "UPDATE {s}_jobs SET state = CASE WHEN ?5 AND failures + 1 < ?6 THEN 'failed' ELSE 'dead' END, \
             failures = failures + 1, run_at = {NOW} + min(?9, ?7 << min(failures, 30)), \
             last_error = CASE WHEN ?5 AND failures + 1 >= ?6 \
               THEN 'failed ' || (failures + 1) || ' times (max_attempts = ' || ?6 || '): ' || ?8 ELSE ?8 END, \
             lease_until = NULL, updated_at = {NOW} WHERE {cas} \
             RETURNING state || ':' || min(?9, ?7 << min(failures - 1, 30))"
        );
        let release = format!(
            "UPDATE {s}_jobs SET state = 'pending', attempts = max(attempts - 1, 0), lease_until = NULL, \
             run_at = {NOW}, updated_at = {NOW} WHERE {cas} RETURNING ''"
        );
        let current = format!("SELECT epoch, owner FROM {s}_jobs WHERE queue = ?1 AND key = ?2");
        let job = format!(
            "SELECT state, epoch, owner, lease_until, attempts, failures, run_at, payload, progress, result, last_error \
             FROM {s}_jobs WHERE queue = ?1 AND key = ?2"
        );
        let ledger_accept = format!(
            "INSERT INTO {s}_ledger (scope, job, epoch, owner, updated_at) VALUES (?1, ?2, ?3, ?4, {NOW}) \
             ON CONFLICT (scope, job) DO UPDATE SET epoch = excluded.epoch, \
             owner = CASE WHEN epoch = excluded.epoch THEN coalesce(owner, excluded.owner) ELSE excluded.owner END, \
             updated_at = excluded.updated_at \
             {ledger_where} RETURNING epoch"
        );
        let ledger_current = format!("SELECT epoch, owner FROM {s}_ledger WHERE scope = ?1 AND job = ?2");
        // ?1 queue, ?2 state, ?3 age ms, ?4 rows: the oldest finished rows by `jobs_finished`
        // (the literal state list lets the planner use the partial index).
        let prune_jobs = format!(
            "DELETE FROM {s}_jobs WHERE rowid IN (SELECT rowid FROM {s}_jobs \
               WHERE queue = ?1 AND state IN ('completed', 'dead') AND state = ?2 AND updated_at < {NOW} - ?3 \
               ORDER BY updated_at LIMIT ?4) RETURNING epoch"
        );
        let raise_floor = format!(
            "INSERT INTO {s}_epoch_floors (queue, floor, updated_at) VALUES (?1, ?2, {NOW}) \
             ON CONFLICT (queue) DO UPDATE SET floor = max(floor, excluded.floor), updated_at = excluded.updated_at"
        );
        let prune_ledger = format!(
            "DELETE FROM {s}_ledger WHERE rowid IN (SELECT rowid FROM {s}_ledger \
               WHERE scope = ?1 AND updated_at < {NOW} - ?2 ORDER BY updated_at LIMIT ?3)"
        );
        Self {
            claim: claim.into(),
            claim_seen: claim_seen.into(),
            enqueue: enqueue.into(),
            next_due: next_due.into(),
            claim_next: claim_next.into(),
            dead_key: dead_key.into(),
            heartbeat: heartbeat.into(),
            checkpoint: checkpoint.into(),
            complete: complete.into(),
            fail: fail.into(),
            release: release.into(),
            current: current.into(),
            job: job.into(),
            ledger_accept: ledger_accept.into(),
            ledger_current: ledger_current.into(),
            prune_jobs: prune_jobs.into(),
            raise_floor: raise_floor.into(),
            prune_ledger: prune_ledger.into(),
        }
    }
}

pub(super) fn sql(s: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    // Every statement is rendered from constant text plus the validated schema name.
    AssertSqlSafe(Arc::clone(s))
}
