//! The PostgreSQL backend: the epoch authority on the database clock.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection};
use tracing::Instrument;

use crate::error::{FenceError, Result};
use crate::guards::Guards;
use crate::key::{JobKey, Owner, QueueName};
use crate::model::{
    Claim, ClaimedJob, DbTime, FailOutcome, Heartbeat, JobRecord, Lease, LeaseDuration, RetryPolicy, millis,
};
use crate::schema::{Migration, SchemaName, render};
use crate::store::{
    FenceStore, JobRow, backoff_ms, claim_outcome, default_max_claims, distinct_keys, fail_outcome, job_record,
    schema_verdict, split_heartbeat,
};

/// Milliseconds since the Unix epoch of a timestamptz expression.
macro_rules! ms {
    ($e:literal) => {
        concat!("floor(extract(epoch from ", $e, ") * 1000)::bigint")
    };
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "jobs and ledger",
        statements: &[
            "CREATE TABLE {s}.jobs (
            queue       text        NOT NULL,
            key         text        NOT NULL,
            state       text        NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'running', 'completed', 'failed', 'dead')),
            epoch       bigint      NOT NULL DEFAULT 0 CHECK (epoch >= 0),
            owner       text,
            lease_until timestamptz,
            attempts    bigint      NOT NULL DEFAULT 0,
            run_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
            payload     bytea,
            progress    bytea,
            result      bytea,
            last_error  text,
            created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (queue, key)
        )",
            "CREATE INDEX jobs_due ON {s}.jobs (queue, run_at) WHERE state IN ('pending', 'failed')",
            "CREATE INDEX jobs_leased ON {s}.jobs (queue, lease_until) WHERE state = 'running'",
            // Defence in depth: the epoch is a fencing token, so no statement may ever lower it.
            "CREATE FUNCTION {s}.epoch_never_decreases() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.epoch < OLD.epoch THEN
             RAISE EXCEPTION 'brokerfence: epoch of %/% would go from % to %', OLD.queue, OLD.key, OLD.epoch, NEW.epoch
               USING ERRCODE = 'check_violation';
           END IF;
           RETURN NEW;
         END $$",
            "CREATE TRIGGER jobs_epoch_never_decreases BEFORE UPDATE OF epoch ON {s}.jobs
         FOR EACH ROW EXECUTE FUNCTION {s}.epoch_never_decreases()",
            "CREATE TABLE {s}.ledger (
            scope      text        NOT NULL,
            job        text        NOT NULL,
            epoch      bigint      NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (scope, job)
        )",
        ],
    },
    Migration {
        version: 2,
        name: "byte-order keys",
        // Queue names, job keys and ledger scopes are opaque identifiers: compared byte by byte, every
        // primary-key probe and index insert skips the locale's string collation (`strcoll`). Under
        // C.UTF-8 that took 5-6 % off a statement of ten keys (claim 0.301 -> 0.285 ms, commit
        // 0.318 -> 0.299 ms, the two forms interleaved in one pgbench run); en_US.UTF-8 collates
        // at a higher cost still. A collation change rebuilds the indexes on these columns, not
        // the table.
        statements: &[
            "ALTER TABLE {s}.jobs ALTER COLUMN queue TYPE text COLLATE \"C\", ALTER COLUMN key TYPE text COLLATE \"C\"",
            "ALTER TABLE {s}.ledger ALTER COLUMN scope TYPE text COLLATE \"C\", ALTER COLUMN job TYPE text COLLATE \"C\"",
        ],
    },
    Migration {
        version: 3,
        name: "failures apart from claims",
        // A constant default: a catalog change only (no table rewrite), under a lock held for
        // milliseconds.
        statements: &["ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS failures bigint NOT NULL DEFAULT 0"],
    },
    Migration {
        version: 4,
        name: "outbox",
        // A new table and its index: nothing existing is locked beyond the schema's catalog (see
        // `crate::outbox`). The partial index serves the relay's "unsent, in id order" claim and
        // stays as small as the backlog.
        statements: crate::outbox::MIGRATION,
    },
    Migration {
        version: 5,
        name: "retention and epoch floors",
        // A new table, a function and two indexes. The indexes are built under a SHARE lock on
        // their table (writes wait while it is built: milliseconds for thousands of rows, seconds
        // for millions; the lock is asked for with the migration lock timeout, see `migrate`).
        // `jobs_finished` holds only completed and dead rows, the pruner's read; `ledger_age`
        // the ledger's, per receiver scope.
        //
        // `epoch_floor(queue)` is what every statement that creates a job row starts its epoch
        // from: the highest epoch pruning ever deleted from the queue (0 without a floor row).
        // It takes the queue's floor lock SHARED (an advisory lock, held to the end of the
        // transaction; the pruner takes it EXCLUSIVE around each batch), then reads the floor in
        // a snapshot of its own (a volatile function does, under READ COMMITTED). So a claim
        // either reads the floor after a batch committed, or the batch waits for the claim: a
        // claim that re-creates a key whose row the batch deleted cannot start it at an epoch
        // read before that delete. It runs as the schema's owner (SECURITY DEFINER, with a fixed
        // search_path): roles that only claim and enqueue need no grant on `epoch_floors`, so
        // the grants of a deployment made before this migration keep working.
        statements: &[
            "CREATE TABLE IF NOT EXISTS {s}.epoch_floors (
            queue      text        COLLATE \"C\" PRIMARY KEY,
            floor      bigint      NOT NULL CHECK (floor >= 0),
            updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )",
            "CREATE OR REPLACE FUNCTION {s}.epoch_floor(q text) RETURNS bigint LANGUAGE plpgsql VOLATILE \
             SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
         BEGIN
           PERFORM pg_advisory_xact_lock_shared(hashtextextended('brokerfence.floor.{s}.' || q, 0));
           RETURN coalesce((SELECT f.floor FROM {s}.epoch_floors f WHERE f.queue = q), 0);
         END $$",
            "CREATE INDEX IF NOT EXISTS jobs_finished ON {s}.jobs (queue, state, updated_at) \
             WHERE state IN ('completed', 'dead')",
            "CREATE INDEX IF NOT EXISTS ledger_age ON {s}.ledger (scope, updated_at)",
        ],
    },
    Migration {
        version: 6,
        name: "room on the page for claims and commits",
        // Issue #18, the fence's WAL per job. Every claim and every commit writes a new version of
        // the job row. With the pages packed full by `enqueue_many` (the default fillfactor, 100)
        // the claims of a page put most new versions on another page: PostgreSQL then logs an
        // extra lock record for the old version and the whole new row (two pages referenced, no
        // prefix/suffix compression). With 30 % of each page kept free the new version stays on
        // its page, and the record holds only the bytes that changed: 25-35 bytes of WAL less per
        // claim (`tests/throughput_cost.rs`, 2,000 jobs in claims of 10: 412.7 -> 387.6 bytes per
        // job, or 389.0 -> 353.7 with claims that leave `updated_at`); commits measured the same
        // either way (the claim's dead version is pruned first). See docs/performance.md.
        //
        // A storage parameter: a catalog change under a SHARE UPDATE EXCLUSIVE lock (reads and
        // writes go on; only other schema changes and VACUUM wait), no table rewrite. It applies
        // to pages filled from then on; pages filled before keep their rows until they are
        // updated or vacuumed. The cost is disk: a backlog of pending jobs takes about 1/0.7 =
        // 1.4 times the pages it took.
        statements: &["ALTER TABLE {s}.jobs SET (fillfactor = 70)"],
    },
];

/// The migration version this build needs: the newest embedded migration.
const REQUIRED_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The statements, rendered once for a schema and a set of guards.
///
/// Every text column they return that comes from a key column carries `COLLATE "C"`: the result
/// type of a prepared statement then stays the same whatever the collation of the column
/// (migration 2 changed it). A prepared statement whose result type changes under it fails with
/// "cached plan must not change result type" on every later run on that connection.
#[derive(Debug)]
pub(crate) struct Statements {
    claim: Arc<str>,
    enqueue: Arc<str>,
    claim_next: Arc<str>,
    heartbeat: Arc<str>,
    checkpoint: Arc<str>,
    complete: Arc<str>,
    fail: Arc<str>,
    release: Arc<str>,
    complete_batch: Arc<str>,
    job: Arc<str>,
    completed_under: Arc<str>,
    pub(crate) ledger_accept: Arc<str>,
    pub(crate) ledger_current: Arc<str>,
    prune_jobs: Arc<str>,
    pub(crate) prune_ledger: Arc<str>,
}

/// Raised on the caller's connection after a fenced [`PgFence::complete_in`]: the transaction is
/// aborted, so the caller's rows cannot commit (SQLSTATE BF409).
const ABORT_FENCED_TX: &str = "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'BF409', \
    MESSAGE = 'brokerfence: complete_in was fenced (a newer epoch holds the job); this transaction cannot commit'; END $$";

/// The compare-and-set every write on behalf of a lease carries ($1 queue, $2 key, $3 owner, $4 epoch).
const CAS: &str = "t.queue = $1 AND t.key = $2 AND t.owner = $3 AND t.epoch = $4 AND t.state = 'running'";
/// What is left of it when the commit guard is switched off (tests only).
const NO_CAS: &str = "t.queue = $1 AND t.key = $2";

/// Wraps a fenced UPDATE so that the same round trip reports the current epoch and owner.
fn fenced(schema: &str, update: &str, returning: &str) -> String {
    format!(
        "WITH upd AS ({update} RETURNING {returning}) \
         SELECT (SELECT count(*) FROM upd)::bigint, (SELECT r FROM upd LIMIT 1), j.epoch, j.owner \
         FROM (SELECT 1) AS one LEFT JOIN {schema}.jobs j ON j.queue = $1 AND j.key = $2"
    )
}

/// The `cur` CTE of the batched statements: for each row of `u` (with `queue` and `key`
/// columns), in (queue, key) order, the job row looked up by primary key and locked, with its
/// newest `cur_epoch`, `cur_owner` and `cur_state` (NULL when there is no such job).
///
/// The lateral lookup (kept apart by `OFFSET 0`) makes the plan one primary-key probe per input
/// row, in key order, and yields the newest version of each row, locked. As a join, a plan made
/// while the table was nearly empty was a hash join over a sequential scan (see
/// [`PgFence::pool_options`] for how the plans are kept index lookups).
fn locked_by_key(s: &str) -> String {
    format!(
        "cur AS MATERIALIZED (SELECT u.*, t.epoch AS cur_epoch, t.owner AS cur_owner, t.state AS cur_state \
         FROM (SELECT * FROM u ORDER BY queue, key) u \
         LEFT JOIN LATERAL (SELECT t.epoch, t.owner, t.state FROM {s}.jobs t \
             WHERE t.queue = u.queue AND t.key = u.key OFFSET 0 FOR UPDATE) t ON true)"
    )
}

/// The SET list of a claim of row `t` by `owner` until `lease_end`, with the cap on claims
/// (`cap`, a parameter): a claim that would exceed it makes the job dead instead (epoch and
/// owner kept, so the last holder stays fenced), naming the cap in `last_error`.
///
/// A claim that makes the job running leaves `updated_at` as it was (nothing reads it on a
/// running row; the pruner ages finished rows by it, set when they finish), a claim that makes it
/// dead sets it. That is WAL: a claimed row's new version is logged from its first changed
/// byte to its last, and `updated_at` is the last column but one, so a claim that set it logged
/// `run_at`, the payload and `created_at` as well (24-34 bytes per claim in
/// `tests/throughput_cost.rs` with a 7-byte payload; a larger payload adds its size).
fn capped_claim(owner: &str, lease_end: &str, cap: &str, inc: &str) -> String {
    let over = format!("t.attempts >= {cap}::bigint");
    format!(
        "state = CASE WHEN {over} THEN 'dead' ELSE 'running' END, \
         epoch = CASE WHEN {over} THEN t.epoch ELSE t.epoch + {inc} END, \
         owner = CASE WHEN {over} THEN t.owner ELSE {owner} END, \
         lease_until = CASE WHEN {over} THEN NULL ELSE {lease_end} END, \
         attempts = CASE WHEN {over} THEN t.attempts ELSE t.attempts + 1 END, \
         last_error = CASE WHEN {over} THEN 'claimed ' || t.attempts::text || \
           ' times without finishing (max_claims = ' || {cap}::bigint::text || ')' ELSE t.last_error END, \
         updated_at = CASE WHEN {over} THEN clock_timestamp() ELSE t.updated_at END"
    )
}

impl Statements {
    pub(crate) fn new(schema: &SchemaName, guards: Guards) -> Self {
        let s = schema.as_str();
        let inc = if guards.epoch_increment { "1" } else { "0" };
        let cas = if guards.commit_cas { CAS } else { NO_CAS };
        let hb_cas = if guards.heartbeat_cas {
            "c.cur_epoch = c.epoch AND c.cur_owner = c.owner AND c.cur_state = 'running'"
        } else {
            "true"
        };
        let (hb_epoch, hb_owner) = if guards.heartbeat_cas { ("t.epoch", "t.owner") } else { ("c.epoch", "c.owner") };
        let ledger_where = if guards.ledger_check { "WHERE l.epoch <= EXCLUDED.epoch" } else { "" };
        let lease_end = "clock_timestamp() + $LEASE::bigint * interval '1 millisecond'";
        // The lease of a taken-over row is computed in the SET, i.e. after the row lock was
        // granted and the WHERE passed: a claim that waited for a lock still gets its full lease,
        // and its lease starts after the previous one ended. The second branch reads the
        // statement's snapshot; a row that looks claimable there but was not claimed changed
        // under us (a concurrent claim), so it is left out and asked again in the next round
        // rather than reported with stale owner/epoch. A row that looked unclaimable there but
        // was claimable once its lock was granted (a lease that ran out meanwhile) comes back
        // from both branches, and the claimed row wins ([`claim_rounds`]): so the branches need
        // no join of one to the other. It looks each key up by primary key through a lateral
        // subquery, for the reason given at [`locked_by_key`].
        let claim = format!(
            "WITH input AS (SELECT k AS key FROM unnest($2::text[]) AS u(k)), \
             claimed AS ( \
               INSERT INTO {s}.jobs AS t (queue, key, state, epoch, owner, lease_until, attempts, run_at) \
               SELECT $1, i.key, 'running', (SELECT {s}.epoch_floor($1)) + 1, $3, {lease}, 1, clock_timestamp() \
               FROM input i ORDER BY i.key \
               ON CONFLICT (queue, key) DO UPDATE SET {capped} \
               WHERE t.state = 'pending' OR (t.state = 'failed' AND t.run_at <= clock_timestamp()) \
                  OR (t.state = 'running' AND t.lease_until < clock_timestamp()) \
               RETURNING t.key, t.state, t.epoch, t.owner, t.lease_until, t.attempts, t.run_at) \
             SELECT c.key COLLATE \"C\", CASE WHEN c.state = 'dead' THEN 'dead' ELSE 'claimed' END, c.epoch, c.owner, \
               {lu}, {ttl}, c.attempts, {ra} FROM claimed c \
             UNION ALL \
             SELECT t.key COLLATE \"C\", t.state, t.epoch, t.owner, {tlu}, {tttl}, t.attempts, {tra} \
             FROM input i CROSS JOIN LATERAL (SELECT t.key, t.state, t.epoch, t.owner, t.lease_until, t.attempts, \
                 t.run_at FROM {s}.jobs t WHERE t.queue = $1 AND t.key = i.key OFFSET 0) t \
             WHERE NOT (t.state = 'pending' OR (t.state = 'failed' AND t.run_at <= clock_timestamp()) \
                 OR (t.state = 'running' AND t.lease_until < clock_timestamp()))",
            lease = lease_end.replace("$LEASE", "$4"),
            capped = capped_claim("EXCLUDED.owner", &lease_end.replace("$LEASE", "$4"), "$5", inc),
            lu = ms!("c.lease_until"),
            ttl = ms!("(c.lease_until - clock_timestamp())"),
            ra = ms!("(c.run_at - clock_timestamp())"),
            tlu = ms!("t.lease_until"),
            tttl = ms!("(t.lease_until - clock_timestamp())"),
            tra = ms!("(t.run_at - clock_timestamp())"),
        );
        let enqueue = format!(
            "INSERT INTO {s}.jobs (queue, key, state, epoch, payload, run_at) \
             SELECT $1, u.k, 'pending', (SELECT {s}.epoch_floor($1)), u.p, clock_timestamp() \
             FROM unnest($2::text[], $3::bytea[]) AS u(k, p) \
             ON CONFLICT (queue, key) DO NOTHING"
        );
        // `(SELECT clock_timestamp())` is read once per statement (an init plan), so the time
        // bound is an index condition that ends each scan at the first row not yet due; compared
        // with the volatile `clock_timestamp()` itself it was a filter, and `expired` read every
        // running row of the queue on each claim.
        let claim_next = format!(
            "WITH expired AS (SELECT queue, key FROM {s}.jobs WHERE queue = $1 AND state = 'running' \
                 AND lease_until < (SELECT clock_timestamp()) ORDER BY lease_until LIMIT $4 FOR UPDATE SKIP LOCKED), \
             due AS (SELECT queue, key FROM {s}.jobs WHERE queue = $1 AND state IN ('pending', 'failed') \
                 AND run_at <= (SELECT clock_timestamp()) ORDER BY run_at LIMIT $4 FOR UPDATE SKIP LOCKED), \
             pick AS (SELECT * FROM (SELECT * FROM expired UNION ALL SELECT * FROM due) p LIMIT $4) \
             UPDATE {s}.jobs t SET {capped} \
             FROM pick WHERE t.queue = pick.queue AND t.key = pick.key \
             RETURNING t.key COLLATE \"C\", t.state, t.epoch, {tlu}, {tttl}, t.attempts, t.payload, t.progress",
            capped = capped_claim("$2", &lease_end.replace("$LEASE", "$3"), "$5", inc),
            tlu = ms!("t.lease_until"),
            tttl = ms!("(t.lease_until - clock_timestamp())"),
        );
        // Rows are locked in (queue, key) order, the order batch claims lock them in, so a
        // heartbeat, a batch commit and a batch claim over the same keys cannot deadlock.
        let cur = locked_by_key(s);
        // The renewal never waits on a row lock: a row another transaction holds locked (the
        // handler's own transaction after `complete_in`, a commit in flight, a takeover's claim)
        // is skipped, and reported `held` (not renewed, not lost) while its committed version
        // still names this lease; see [`Heartbeat::held`]. One stuck transaction thus never holds
        // up the renewal of the worker's other leases.
        let heartbeat = format!(
            "WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) \
                 AS u(queue, key, epoch, owner)), {cur}, \
             upd AS (UPDATE {s}.jobs t SET lease_until = {lease}, updated_at = clock_timestamp() \
                 FROM cur c WHERE t.queue = c.queue AND t.key = c.key AND {hb_cas} \
                 RETURNING t.queue, t.key, {hb_epoch} AS epoch, {hb_owner} AS owner, {tlu} AS lu, {tttl} AS ttl) \
             SELECT upd.queue COLLATE \"C\", upd.key COLLATE \"C\", upd.epoch, upd.owner, upd.lu, upd.ttl, true \
             FROM upd \
             UNION ALL \
             SELECT c.queue COLLATE \"C\", c.key COLLATE \"C\", c.epoch, c.owner, NULL::bigint, NULL::bigint, false \
             FROM cur c CROSS JOIN LATERAL (SELECT 1 FROM {s}.jobs j WHERE j.queue = c.queue AND j.key = c.key \
                 AND j.epoch = c.epoch AND j.owner = c.owner AND j.state = 'running' OFFSET 0) j \
             WHERE c.cur_epoch IS NULL",
            cur = cur.replace(" OFFSET 0 FOR UPDATE) t ON true)", " OFFSET 0 FOR UPDATE SKIP LOCKED) t ON true)"),
            lease = lease_end.replace("$LEASE", "$5"),
            tlu = ms!("t.lease_until"),
            tttl = ms!("(t.lease_until - clock_timestamp())"),
        );
        let batch_cas = if guards.commit_cas {
            "c.cur_owner = c.owner AND c.cur_epoch = c.epoch AND c.cur_state = 'running'"
        } else {
            "true"
        };
        // One row per item with the epoch and owner of the row version this statement locked
        // (false), and one more per item committed (true): the verdicts are put together in
        // [`PgFence::complete_batch`] rather than by joining the two here.
        let complete_batch = format!(
            "WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bytea[]) \
                 AS u(queue, key, owner, epoch, result)), {cur}, \
             upd AS (UPDATE {s}.jobs t SET state = 'completed', result = c.result, lease_until = NULL, \
                 updated_at = clock_timestamp() FROM cur c \
                 WHERE t.queue = c.queue AND t.key = c.key AND {batch_cas} RETURNING t.queue, t.key) \
             SELECT c.queue COLLATE \"C\", c.key COLLATE \"C\", false, c.cur_epoch, c.cur_owner FROM cur c \
             UNION ALL SELECT upd.queue COLLATE \"C\", upd.key COLLATE \"C\", true, NULL::bigint, NULL::text FROM upd"
        );
        let checkpoint = fenced(
            s,
            &format!("UPDATE {s}.jobs t SET progress = $5, updated_at = clock_timestamp() WHERE {cas}"),
            "''::text AS r",
        );
        let complete = fenced(
            s,
            &format!(
                "UPDATE {s}.jobs t SET state = 'completed', result = $5, lease_until = NULL, \
                 updated_at = clock_timestamp() WHERE {cas}"
            ),
            "''::text AS r",
        );
        let fail = fenced(
            s,
            &format!(
                "UPDATE {s}.jobs t SET state = CASE WHEN $5 AND t.failures + 1 < $6 THEN 'failed' ELSE 'dead' END, \
                 failures = t.failures + 1, \
                 run_at = clock_timestamp() + {delay} * interval '1 millisecond', \
                 last_error = CASE WHEN $5 AND t.failures + 1 >= $6 \
                   THEN 'failed ' || (t.failures + 1)::text || ' times (max_attempts = ' || $6::bigint::text || '): ' || $8 \
                   ELSE $8 END, \
                 lease_until = NULL, updated_at = clock_timestamp() WHERE {cas}",
                delay = "least($9::bigint, $7::bigint * (1::bigint << least(t.failures, 30)::int))",
            ),
            // The state and the backoff just applied (failures has grown by one here).
            "t.state || ':' || least($9::bigint, $7::bigint * (1::bigint << least(t.failures - 1, 30)::int))::text AS r",
        );
        let release = fenced(
            s,
            &format!(
                "UPDATE {s}.jobs t SET state = 'pending', attempts = greatest(t.attempts - 1, 0), \
                 lease_until = NULL, run_at = clock_timestamp(), updated_at = clock_timestamp() WHERE {cas}"
            ),
            "''::text AS r",
        );
        let job = format!(
            "SELECT t.state, t.epoch, t.owner, {tlu}, t.attempts, t.failures, {tra}, t.payload, t.progress, t.result, \
             t.last_error \
             FROM {s}.jobs t WHERE t.queue = $1 AND t.key = $2",
            tlu = ms!("t.lease_until"),
            tra = ms!("t.run_at"),
        );
        // One primary-key probe per lease (the lateral lookup, as in `locked_by_key`), no lock.
        let completed_under = format!(
            "SELECT u.i, coalesce(t.state = 'completed' AND t.epoch = u.epoch AND t.owner = u.owner, false) \
             FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) WITH ORDINALITY AS u(queue, key, epoch, owner, i) \
             LEFT JOIN LATERAL (SELECT t.state, t.epoch, t.owner FROM {s}.jobs t \
                 WHERE t.queue = u.queue AND t.key = u.key OFFSET 0) t ON true"
        );
        // No row back means refused. The newest epoch is then read by a second statement: the
        // statement snapshot of this one may predate the row that refused it.
        let ledger_accept = format!(
            "INSERT INTO {s}.ledger AS l (scope, job, epoch) VALUES ($1, $2, $3) \
             ON CONFLICT (scope, job) DO UPDATE SET epoch = EXCLUDED.epoch, updated_at = clock_timestamp() \
             {ledger_where} RETURNING l.epoch"
        );
        let ledger_current = format!("SELECT epoch FROM {s}.ledger WHERE scope = $1 AND job = $2");
        // One batch of pruning ($1 queue, $2 state, $3 age in ms, $4 rows): the oldest finished
        // rows by the `jobs_finished` index, rows another transaction holds skipped, deleted by
        // their row address (a tid scan: the rows are locked, so their addresses hold), and the
        // queue's epoch floor raised to the highest epoch deleted, all in one statement. Answers
        // the rows deleted and the floor (NULL when nothing was deleted). The cutoff is on the
        // database clock at the start of the statement (`statement_timestamp()`, stable, so it is
        // an index condition: the scan stops at the cutoff instead of filtering past it).
        let prune_jobs = format!(
            "WITH victims AS (SELECT t.ctid AS id FROM {s}.jobs t WHERE t.queue = $1 \
                 AND t.state IN ('completed', 'dead') AND t.state = $2 \
                 AND t.updated_at < statement_timestamp() - $3::bigint * interval '1 millisecond' \
                 ORDER BY t.updated_at LIMIT $4 FOR UPDATE SKIP LOCKED), \
             del AS (DELETE FROM {s}.jobs t WHERE t.ctid = ANY (ARRAY(SELECT v.id FROM victims v)) RETURNING t.epoch), \
             top AS (SELECT count(*)::bigint AS n, max(del.epoch) AS e FROM del), \
             fl AS (INSERT INTO {s}.epoch_floors AS f (queue, floor) SELECT $1, top.e FROM top WHERE top.n > 0 \
                 ON CONFLICT (queue) DO UPDATE SET floor = greatest(f.floor, EXCLUDED.floor), \
                 updated_at = clock_timestamp() RETURNING f.floor) \
             SELECT top.n, (SELECT fl.floor FROM fl) FROM top"
        );
        // One batch of ledger pruning ($1 scope, $2 age in ms, $3 rows), by the `ledger_age` index.
        let prune_ledger = format!(
            "WITH victims AS (SELECT l.ctid AS id FROM {s}.ledger l WHERE l.scope = $1 \
                 AND l.updated_at < statement_timestamp() - $2::bigint * interval '1 millisecond' \
                 ORDER BY l.updated_at LIMIT $3 FOR UPDATE SKIP LOCKED) \
             DELETE FROM {s}.ledger l WHERE l.ctid = ANY (ARRAY(SELECT v.id FROM victims v))"
        );
        Self {
            claim: claim.into(),
            enqueue: enqueue.into(),
            claim_next: claim_next.into(),
            heartbeat: heartbeat.into(),
            checkpoint: checkpoint.into(),
            complete: complete.into(),
            fail: fail.into(),
            release: release.into(),
            complete_batch: complete_batch.into(),
            job: job.into(),
            completed_under: completed_under.into(),
            ledger_accept: ledger_accept.into(),
            ledger_current: ledger_current.into(),
            prune_jobs: prune_jobs.into(),
            prune_ledger: prune_ledger.into(),
        }
    }
}

/// Runs a statement's future in a task of its own, so that a caller who stops waiting (a
/// timeout, a dropped future) never drops the statement mid-flight. sqlx hands a connection whose
/// statement was dropped back to the pool only after pinging it; when the abandoned statement then
/// ends in an error (a `lock_timeout`), the ping fails and the connection was seen to stay lost to
/// its pool: two abandoned heartbeats left the two reserved heartbeat connections unusable, and
/// every later renewal of the worker timed out. Detached, the statement ends on its own (bounded
/// by the connection's `statement_timeout` and `lock_timeout`) and its connection goes back to the
/// pool like any other.
async fn detached<T: Send + 'static>(statement: impl Future<Output = Result<T>> + Send + 'static) -> Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => runtime.spawn(statement).await.map_err(|e| FenceError::StatementAborted(e.to_string()))?,
        Err(_) => statement.await,
    }
}

/// The identity columns of `leases` (queue, key, epoch, owner), as arrays for `unnest`.
fn lease_columns(leases: &[Lease]) -> (Vec<String>, Vec<String>, Vec<i64>, Vec<String>) {
    let mut columns = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for l in leases {
        columns.0.push(l.queue.as_str().to_owned());
        columns.1.push(l.key.as_str().to_owned());
        columns.2.push(l.epoch);
        columns.3.push(l.owner.as_str().to_owned());
    }
    columns
}

fn sql(s: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    // Every statement is rendered from constant text plus the validated schema name.
    AssertSqlSafe(Arc::clone(s))
}

/// The fence on PostgreSQL.
///
/// ```no_run
/// # async fn demo() -> brokerfence::Result<()> {
/// use brokerfence::{FenceStore, PgFence, SchemaName};
/// let fence = PgFence::connect("postgres://postgres@127.0.0.1/test").await?
///     .with_schema(SchemaName::new("my_fence")?);
/// fence.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgFence {
    pool: PgPool,
    /// Reserved capacity for [`heartbeat`](FenceStore::heartbeat): claims and commits that fill
    /// `pool` never make a renewal wait for a connection.
    heartbeat_pool: PgPool,
    schema: SchemaName,
    guards: Guards,
    pub(crate) stmts: Arc<Statements>,
    max_claims: i64,
    migration: MigrationLimits,
}

/// How [`PgFence::migrate`](FenceStore::migrate) waits for its locks.
#[derive(Debug, Clone, Copy)]
struct MigrationLimits {
    lock_timeout: Duration,
    give_up_after: Duration,
}

impl Default for MigrationLimits {
    fn default() -> Self {
        Self { lock_timeout: Duration::from_millis(200), give_up_after: Duration::from_secs(600) }
    }
}

impl std::fmt::Debug for PgFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgFence").field("schema", &self.schema).field("guards", &self.guards).finish_non_exhaustive()
    }
}

/// What every connection of a fence pool runs once, when it opens (see [`PgFence::pool_options`]):
/// the planner may use only index scans and nested loops on that connection, so that a plan the
/// server keeps for a fence statement looks rows up by key whatever the jobs table looked like
/// when it was made, and it keeps that one plan from the first call on. Bitmap scans are off
/// too: on a jobs table that was never analyzed the planner guesses a row or two per queue, and
/// for `claim_next` it then picked a bitmap scan over every due row plus a sort (62–67 ms per
/// claim of ten with 76,000 jobs pending, the sort spilling to disk) over the index-order scan
/// that stops after ten rows. For a pool built some other way, run it on each new connection
/// (five `SET`s, sent as one simple query):
///
/// ```no_run
/// # async fn demo() -> Result<(), sqlx::Error> {
/// let pool = sqlx::postgres::PgPoolOptions::new()
///     .after_connect(|conn, _| Box::pin(async move {
///         sqlx::Executor::execute(&mut *conn, brokerfence::PG_SESSION_SETUP).await.map(drop)
///     }))
///     .connect("postgres://127.0.0.1/jobs")
///     .await?;
/// let fence = brokerfence::PgFence::new(pool);
/// # let _ = fence; Ok(()) }
/// ```
pub const PG_SESSION_SETUP: &str = "SET enable_seqscan = off; SET enable_bitmapscan = off; SET enable_hashjoin = off; \
                                     SET enable_mergejoin = off; SET plan_cache_mode = force_generic_plan";

/// The schemes [`PgFence::connect`] accepts, as its [`FenceError::UnsupportedScheme`] names them.
const PG_SCHEMES: &str = "postgres:// or postgresql:// (PostgreSQL; for SQLite use SqliteFence::open with sqlite:PATH)";

/// How long the one direct connection attempt [`PgFence::connect`] and
/// [`PgFence::connect_with`] make before building their pool may take (10 s, the pool's acquire
/// timeout): past it the connect fails with [`FenceError::Unreachable`].
pub const CONNECT_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// One direct connection to `options`, closed at once: the real cause when the server cannot be
/// reached or refuses the connection (a pool only says that it timed out).
async fn probe(options: &sqlx::postgres::PgConnectOptions) -> Result<()> {
    let unreachable = |cause: String| FenceError::Unreachable {
        host: options.get_host().to_owned(),
        port: options.get_port(),
        cause,
    };
    match tokio::time::timeout(CONNECT_PROBE_TIMEOUT, PgConnection::connect_with(options)).await {
        Err(_) => Err(unreachable(format!("no answer within {} s", CONNECT_PROBE_TIMEOUT.as_secs()))),
        Ok(Ok(conn)) => {
            // Terminate politely, but never wait long for it.
            let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
            Ok(())
        }
        // A certificate that does not verify is an I/O error of kind InvalidData: keep it as it
        // is (`FenceError::Database`), like every TLS failure.
        Ok(Err(sqlx::Error::Io(io))) if io.kind() != std::io::ErrorKind::InvalidData => {
            Err(unreachable(lowercase_first(&io.to_string())))
        }
        // 28xxx: authentication; 3D000: no such database; 53300: too many connections.
        Ok(Err(sqlx::Error::Database(db)))
            if db.code().is_some_and(|c| c.starts_with("28") || c == "3D000" || c == "53300") =>
        {
            Err(FenceError::ConnectRejected {
                host: options.get_host().to_owned(),
                port: options.get_port(),
                user: options.get_username().to_owned(),
                database: options.get_database().unwrap_or(options.get_username()).to_owned(),
                cause: db.message().to_owned(),
            })
        }
        Ok(Err(e)) => Err(e.into()),
    }
}

/// `s` with its first letter in lower case ("Connection refused" reads as a cause in a sentence).
fn lowercase_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Server-side time limits of a fence's connections, sent as startup options of each connection
/// (`-c statement_timeout=… -c lock_timeout=…` in the startup packet): no statement pays an extra
/// round trip for them.
///
/// Fence statements touch a few rows by key and take milliseconds; one that waits longer for a
/// lock (a row held by a stalled transaction, a table lock queued by a migration) or runs longer
/// gives up with [`FenceError::LockTimeout`] or [`FenceError::StatementTimeout`] instead of
/// hanging past the lease it serves. Nothing the statement wrote is kept; the caller retries.
///
/// The defaults fit the shortest lease ([`MIN_LEASE`](crate::MIN_LEASE), 3 s, renewed every
/// second): a heartbeat gives up after 1 s waiting for a lock (by then the next one is due) or
/// 2 s in all (a renewal that ends later than that renews a lease that may have ended already);
/// claims and commits wait at most 3 s for a lock and run at most 10 s. Longer leases can afford
/// longer limits; shorter limits than the defaults make spurious failures likelier on a loaded
/// server. (A [`Supervisor`](crate::Supervisor) also stops waiting for a heartbeat after one
/// heartbeat interval; these limits free the server's side of it.)
///
/// The main pool's limits also apply to what a caller runs on [`PgFence::pool`] connections (for
/// example the business statements of a [`complete_in`](PgFence::complete_in) transaction).
/// Migrations override both per transaction (see [`PgFence::with_migration_lock_timeout`]).
/// Connection poolers that drop startup options (PgBouncer in transaction mode) need the limits set
/// on the database role instead (`ALTER ROLE … SET lock_timeout = …`).
///
/// ```no_run
/// # async fn demo() -> brokerfence::Result<()> {
/// use std::time::Duration;
/// use brokerfence::{PgFence, PgTimeouts};
/// let timeouts = PgTimeouts { lock: Duration::from_secs(10), statement: Duration::from_secs(30), ..PgTimeouts::default() };
/// let options: sqlx::postgres::PgConnectOptions = "postgres://127.0.0.1/jobs".parse()?;
/// let fence = PgFence::connect_with_timeouts(options, timeouts).await?;
/// # let _ = fence; Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PgTimeouts {
    /// `statement_timeout` of the main pool (claims, commits, fail, release, the ledger). Default 10 s.
    pub statement: Duration,
    /// `lock_timeout` of the main pool. Default 3 s.
    pub lock: Duration,
    /// `statement_timeout` of the heartbeat connections. Default 2 s.
    pub heartbeat_statement: Duration,
    /// `lock_timeout` of the heartbeat connections. Default 1 s (below the statement limit, so
    /// that a renewal stuck on a lock says so).
    pub heartbeat_lock: Duration,
    /// Connections reserved for heartbeats, apart from the main pool. Default 2 (a renewal in
    /// flight and the next one).
    pub heartbeat_connections: u32,
}

impl Default for PgTimeouts {
    fn default() -> Self {
        Self {
            statement: Duration::from_secs(10),
            lock: Duration::from_secs(3),
            heartbeat_statement: Duration::from_secs(2),
            heartbeat_lock: Duration::from_secs(1),
            heartbeat_connections: 2,
        }
    }
}

/// A duration as a PostgreSQL time setting in whole milliseconds, at least 1 (0 would mean "no limit").
fn pg_ms(d: Duration) -> u128 {
    d.as_millis().max(1)
}

impl PgTimeouts {
    /// `options` with the main pool's limits added as startup options (later ones win, so these
    /// override a `statement_timeout` or `lock_timeout` already in `options`).
    pub fn apply(&self, options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
        options.options([("statement_timeout", pg_ms(self.statement)), ("lock_timeout", pg_ms(self.lock))])
    }

    /// `options` with the heartbeat connections' limits added as startup options.
    pub fn apply_heartbeat(&self, options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
        options.options([
            ("statement_timeout", pg_ms(self.heartbeat_statement)),
            ("lock_timeout", pg_ms(self.heartbeat_lock)),
        ])
    }

    /// The pool of reserved heartbeat connections: opened on first use (then kept while in use, like any pool's), each with
    /// [`PG_SESSION_SETUP`] and the heartbeat limits.
    fn heartbeat_pool(&self, options: sqlx::postgres::PgConnectOptions) -> PgPool {
        PgFence::pool_options()
            .max_connections(self.heartbeat_connections.max(1))
            .connect_lazy_with(self.apply_heartbeat(options))
    }
}

impl PgFence {
    /// One renewal statement for `leases` on the heartbeat connections, detached from the caller.
    async fn renew(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        if leases.is_empty() {
            return Ok(Heartbeat::default());
        }
        let (queues, keys, epochs, owners) = lease_columns(leases);
        let (pool, statement, ms) = (self.heartbeat_pool.clone(), sql(&self.stmts.heartbeat), lease.as_millis_i64());
        type Row = (String, String, i64, String, Option<i64>, Option<i64>, bool);
        let rows: Vec<Row> = detached(async move {
            Ok(sqlx::query_as(statement)
                .bind(queues)
                .bind(keys)
                .bind(epochs)
                .bind(owners)
                .bind(ms)
                .fetch_all(&pool)
                .await?)
        })
        .await?;
        let (mut renewed, mut held) = (Vec::with_capacity(rows.len()), Vec::new());
        for (queue, key, epoch, owner, until, ttl, was_renewed) in rows {
            match (was_renewed, until, ttl) {
                (true, Some(until), Some(ttl)) => renewed.push((queue, key, epoch, owner, until, ttl)),
                _ => held.push((queue, key, epoch, owner)),
            }
        }
        Ok(split_heartbeat(leases, renewed, held))
    }

    /// The pool options [`connect`](Self::connect) and [`connect_with`](Self::connect_with) use:
    /// up to 16 connections, 10 s to acquire one, and [`PG_SESSION_SETUP`] on each new connection.
    /// Build your own pool from them (then [`PgFence::new`]) to change the limits and keep the rest.
    ///
    /// Planning is the larger part of a fence statement's cost (a batch claim of ten keys: 0.27 ms
    /// to plan, 0.18 ms to run), so the setup has each connection plan each statement once and
    /// keep that generic plan. A generic plan is only as good as the table it was made for, though:
    /// made while the jobs table was small and freshly analyzed, it is a sequential scan (or a hash
    /// join over the whole table), and every later call reads the whole table until the next
    /// `ANALYZE` (up to a minute of autovacuum's nap, while a burst grows the table). Measured: one
    /// round of every fence statement read 1,006,059 rows of a 20,000-row table. The setup's other
    /// three settings leave the planner index lookups in nested loops only, which is what each
    /// fence statement wants (each looks rows up by key or reads an index in order): the same
    /// round reads about 40 rows. The settings only price the other plans out; a query with no
    /// index to use still runs. Queries of another kind (reports, large joins) belong on a pool of
    /// their own.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), sqlx::Error> {
    /// let pool = brokerfence::PgFence::pool_options().max_connections(4).connect("postgres://127.0.0.1/jobs").await?;
    /// let fence = brokerfence::PgFence::new(pool);
    /// # let _ = fence; Ok(()) }
    /// ```
    pub fn pool_options() -> PgPoolOptions {
        PgPoolOptions::new().max_connections(16).acquire_timeout(Duration::from_secs(10)).after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(&mut *conn, PG_SESSION_SETUP).await?;
                Ok(())
            })
        })
    }

    /// Connects a pool of up to 16 connections to `url` ([`pool_options`](Self::pool_options)),
    /// with the default [`PgTimeouts`] and their reserved heartbeat connections.
    ///
    /// `url` must be a PostgreSQL URL (`postgres://` or `postgresql://`): any other scheme fails
    /// at once with [`FenceError::UnsupportedScheme`]. A server that cannot be reached fails
    /// with [`FenceError::Unreachable`] (host, port and cause), one that refuses the user or
    /// database with [`FenceError::ConnectRejected`]; see [`connect_with`](Self::connect_with).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let err = brokerfence::PgFence::connect("mysql://root@127.0.0.1/jobs").await.unwrap_err();
    /// assert!(matches!(err, brokerfence::FenceError::UnsupportedScheme { ref scheme, .. } if scheme == "mysql"));
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self> {
        crate::error::require_scheme(url, &["postgres", "postgresql"], PG_SCHEMES)?;
        let options: sqlx::postgres::PgConnectOptions = url.parse()?;
        Self::connect_with_timeouts(options, PgTimeouts::default()).await
    }

    /// [`connect_with`](Self::connect_with) with other time limits (see [`PgTimeouts`]).
    pub async fn connect_with_timeouts(
        options: sqlx::postgres::PgConnectOptions,
        timeouts: PgTimeouts,
    ) -> Result<Self> {
        probe(&timeouts.apply(options.clone())).await?;
        let pool = Self::pool_options().connect_with(timeouts.apply(options.clone())).await?;
        Ok(Self::new(pool).with_heartbeat_pool(timeouts.heartbeat_pool(options)))
    }

    /// Connects a pool of up to 16 connections ([`pool_options`](Self::pool_options)) with options
    /// you built: TLS (`ssl_mode`, root and client certificates), credentials kept out of URLs, an
    /// `application_name` that shows in `pg_stat_activity`.
    ///
    /// TLS needs the `tls` feature (rustls on *ring*, the system's root certificates). A mode that
    /// insists on TLS (`Require`, `VerifyCa`, `VerifyFull`) fails with
    /// [`FenceError::Database`]`(sqlx::Error::Tls(..))` when the server offers no TLS, or when the
    /// crate was built without the feature; a certificate that does not verify (`VerifyCa`,
    /// `VerifyFull`) fails with `FenceError::Database(sqlx::Error::Io(..))` of kind `InvalidData`
    /// naming the certificate problem. `Prefer` falls back to plain TCP.
    ///
    /// Before the pool is built, one direct connection is opened (and closed) with a bound of
    /// [`CONNECT_PROBE_TIMEOUT`]: a server that cannot be reached fails at once with
    /// [`FenceError::Unreachable`] naming the host, port and cause (connection refused, a name
    /// that does not resolve, no answer in time), and one that answers but refuses the user or
    /// database fails with [`FenceError::ConnectRejected`] and the server's message, rather
    /// than the pool's "timed out while waiting for an open connection" after its acquire timeout.
    ///
    /// Note: sqlx's `PgConnectOptions` prints its password in `Debug`; never log the options.
    /// [`PgFence`]'s own `Debug` shows neither the options nor the credentials.
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use sqlx::postgres::{PgConnectOptions, PgSslMode};
    /// let password = std::env::var("PGPASSWORD").unwrap_or_default();
    /// let options = PgConnectOptions::new()
    ///     .host("db.internal")
    ///     .username("billing")
    ///     .password(&password)
    ///     .database("jobs")
    ///     .ssl_mode(PgSslMode::VerifyFull)
    ///     .ssl_root_cert("/etc/ssl/certs/db-ca.pem")
    ///     .application_name("billing-worker");
    /// let fence = brokerfence::PgFence::connect_with(options).await?;
    /// # let _ = fence; Ok(()) }
    /// ```
    pub async fn connect_with(options: sqlx::postgres::PgConnectOptions) -> Result<Self> {
        Self::connect_with_timeouts(options, PgTimeouts::default()).await
    }

    /// Uses an existing pool, with the default schema. Build it from
    /// [`pool_options`](Self::pool_options), or run [`PG_SESSION_SETUP`] on its connections; add
    /// [`PgTimeouts::apply`] to its connect options for the fence's time limits (a pool built
    /// without them keeps whatever limits its connections have).
    ///
    /// Heartbeats get their own connections (up to two, opened on first use with the pool's
    /// connect options, [`PG_SESSION_SETUP`] and the default heartbeat limits of [`PgTimeouts`]),
    /// so a pool kept busy by claims and commits never delays a renewal. Outside a tokio runtime
    /// there is no such pool to open: heartbeats then share `pool`.
    /// [`with_heartbeat_pool`](Self::with_heartbeat_pool) supplies another.
    pub fn new(pool: PgPool) -> Self {
        let schema = SchemaName::default();
        let guards = Guards::default();
        let stmts = Arc::new(Statements::new(&schema, guards));
        let heartbeat_pool = if tokio::runtime::Handle::try_current().is_ok() {
            PgTimeouts::default().heartbeat_pool((*pool.connect_options()).clone())
        } else {
            pool.clone()
        };
        Self {
            pool,
            heartbeat_pool,
            schema,
            guards,
            stmts,
            max_claims: default_max_claims(),
            migration: MigrationLimits::default(),
        }
    }

    /// Caps the claims of one job at `n` (at least 1; default 20,
    /// [`RetryPolicy::max_claims`] of the default policy): a claim that would exceed it makes
    /// the job dead, with the last error "claimed N times without finishing (max_claims = M)",
    /// and answers [`Claim::Dead`]. Claims count takeovers of stalled or killed holders, which
    /// are not the job's fault and do not count against [`RetryPolicy::max_attempts`]: this is
    /// the cap against a job that kills every worker that runs it. Keep it well above
    /// `max_attempts` (`policy.max_claims()` suggests a value).
    pub fn with_max_claims(mut self, n: i64) -> Self {
        self.max_claims = n.max(1);
        self
    }

    /// The cap on claims of one job (see [`with_max_claims`](Self::with_max_claims)).
    pub fn max_claims(&self) -> i64 {
        self.max_claims
    }

    /// How long each migration step waits for its table locks before it lets go and retries
    /// (default 200 ms). A schema change needs an exclusive lock on the table it changes; while
    /// it waits for one, every statement on that table queues behind it, heartbeats included.
    /// So [`migrate`](FenceStore::migrate) waits at most this long, gives the lock up (the queue
    /// moves on), backs off (200 ms doubling to 5 s, with jitter) and tries again, for at most
    /// `give_up_after` (default 10 min) before it fails with the lock timeout.
    pub fn with_migration_lock_timeout(mut self, lock_timeout: Duration, give_up_after: Duration) -> Self {
        self.migration = MigrationLimits { lock_timeout: lock_timeout.max(Duration::from_millis(1)), give_up_after };
        self
    }

    /// Renews leases on `pool` (reserved capacity: give it connections the main pool cannot use
    /// up, with [`PG_SESSION_SETUP`] and time limits that fit the lease, see
    /// [`PgTimeouts::apply_heartbeat`]).
    pub fn with_heartbeat_pool(mut self, pool: PgPool) -> Self {
        self.heartbeat_pool = pool;
        self
    }

    /// Uses another schema (created by [`migrate`](FenceStore::migrate)).
    pub fn with_schema(mut self, schema: SchemaName) -> Self {
        self.stmts = Arc::new(Statements::new(&schema, self.guards));
        self.schema = schema;
        self
    }

    /// TEST ONLY (feature `guard-switches`): runs with some guards switched off.
    #[cfg(feature = "guard-switches")]
    #[doc(hidden)]
    pub fn with_guards(mut self, guards: Guards) -> Self {
        self.stmts = Arc::new(Statements::new(&self.schema, guards));
        self.guards = guards;
        self
    }

    /// The guards in force.
    pub fn guards(&self) -> Guards {
        self.guards
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The connections reserved for heartbeats.
    pub fn heartbeat_pool(&self) -> &PgPool {
        &self.heartbeat_pool
    }

    /// The schema.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// [`complete`](FenceStore::complete) inside the caller's transaction, so that the caller's own
    /// rows (business data, outbox) commit together with the result or not at all. Inside a
    /// supervised handler, call [`JobContext::complete_in`](crate::JobContext::complete_in)
    /// instead: it tells the supervisor, which then acknowledges the delivery without a second
    /// commit.
    ///
    /// A [`Fenced`](FenceError::Fenced) answer also **aborts the caller's transaction** (an error
    /// raised on its connection): its rows can no longer commit, every later statement in it
    /// fails, and `COMMIT` rolls it back, even if the caller ignores the answer. Call it last,
    /// right before `COMMIT`: from here on the transaction holds the job's row lock (see
    /// [`Heartbeat::held`]).
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence, lease: brokerfence::Lease) -> brokerfence::Result<()> {
    /// let mut tx = fence.pool().begin().await?;
    /// sqlx::query("INSERT INTO outbox (body) VALUES ($1)").bind("hello").execute(&mut *tx).await?;
    /// fence.complete_in(&mut tx, &lease, b"done").await?; // Fenced => the transaction is aborted
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(&self, conn: &mut PgConnection, lease: &Lease, result: &[u8]) -> Result<()> {
        let answer = self.fenced_write(&mut *conn, &self.stmts.complete, lease, |q| q.bind(result.to_vec())).await;
        if let Err(FenceError::Fenced { .. }) = &answer
            && self.guards.fenced_tx_rollback()
        {
            // Raises on purpose: PostgreSQL then refuses every later statement of the transaction
            // and turns its COMMIT into a ROLLBACK. The raise is the expected answer; any other
            // error leaves the transaction aborted all the same.
            let raised = sqlx::raw_sql(ABORT_FENCED_TX).execute(&mut *conn).await;
            tracing::debug!(key = %lease.key, epoch = lease.epoch, ?raised, "fenced complete_in: caller's transaction aborted");
        }
        answer.map(drop)
    }

    /// [`enqueue`](FenceStore::enqueue) inside the caller's transaction: the job exists if and only
    /// if the caller's transaction commits (transactional enqueue). Says whether it inserted (a key
    /// that exists is left as it is).
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, QueueName};
    /// let mut tx = fence.pool().begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind("o-1").execute(&mut *tx).await?;
    /// fence.enqueue_in(&mut tx, &QueueName::new("emails")?, &JobKey::new("o-1/confirm")?, b"o-1").await?;
    /// tx.commit().await?; // the order and its job, or neither
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_in(
        &self,
        conn: &mut PgConnection,
        queue: &QueueName,
        key: &JobKey,
        payload: &[u8],
    ) -> Result<bool> {
        Ok(self.enqueue_many_in(conn, queue, &[(key.clone(), payload.to_vec())]).await? == 1)
    }

    /// [`enqueue_many`](FenceStore::enqueue_many) inside the caller's transaction (one statement);
    /// returns how many were new.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, QueueName};
    /// let mut tx = fence.pool().begin().await?;
    /// let jobs = vec![(JobKey::new("a")?, b"1".to_vec()), (JobKey::new("b")?, b"2".to_vec())];
    /// assert_eq!(fence.enqueue_many_in(&mut tx, &QueueName::new("q")?, &jobs).await?, 2);
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_many_in(
        &self,
        conn: &mut PgConnection,
        queue: &QueueName,
        jobs: &[(JobKey, Vec<u8>)],
    ) -> Result<u64> {
        self.enqueue_on(&mut *conn, queue, jobs).await
    }

    async fn enqueue_on<'c>(
        &self,
        exec: impl sqlx::PgExecutor<'c>,
        queue: &QueueName,
        jobs: &[(JobKey, Vec<u8>)],
    ) -> Result<u64> {
        let keys: Vec<String> = jobs.iter().map(|(k, _)| k.as_str().to_owned()).collect();
        let payloads: Vec<Vec<u8>> = jobs.iter().map(|(_, p)| p.clone()).collect();
        let done = sqlx::query(sql(&self.stmts.enqueue))
            .bind(queue.as_str().to_owned())
            .bind(keys)
            .bind(payloads)
            .execute(exec)
            .await?;
        Ok(done.rows_affected())
    }

    async fn fenced_write<'c, E, F>(&self, exec: E, stmt: &Arc<str>, lease: &Lease, extra: F) -> Result<Option<String>>
    where
        E: sqlx::PgExecutor<'c>,
        F: for<'q> FnOnce(
            sqlx::query::QueryAs<'q, sqlx::Postgres, FencedRow, sqlx::postgres::PgArguments>,
        ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, FencedRow, sqlx::postgres::PgArguments>,
    {
        let q = sqlx::query_as::<_, FencedRow>(sql(stmt))
            .bind(lease.queue.as_str().to_owned())
            .bind(lease.key.as_str().to_owned())
            .bind(lease.owner.as_str().to_owned())
            .bind(lease.epoch);
        let (matched, r, current_epoch, current_owner) = extra(q).fetch_one(exec).await?;
        if matched == 0 {
            return Err(FenceError::Fenced {
                key: lease.key.as_str().to_owned(),
                epoch: lease.epoch,
                current_epoch: current_epoch.unwrap_or(0),
                current_owner,
            });
        }
        Ok(r)
    }

    /// One migration (or, with `None`, only the schema and its record) with retries: a lock
    /// timeout rolls the step back, waits (200 ms doubling to 5 s, with jitter) and tries again
    /// until `give_up_after` has passed.
    async fn migration_step(&self, conn: &mut PgConnection, m: Option<&Migration>) -> Result<()> {
        let started = std::time::Instant::now();
        // 200 ms doubling, at most 5 s, with jitter so that migrators retrying together do not
        // keep colliding (each pause between the step, capped at 2.5 s, and twice it).
        let mut pauses = {
            use backon::BackoffBuilder as _;
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_millis(2_500))
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build()
        };
        let mut tries = 0u32;
        loop {
            tries += 1;
            match self.migration_try(conn, m).await {
                Ok(()) => return Ok(()),
                Err(e) if is_lock_timeout(&e) && started.elapsed() < self.migration.give_up_after => {
                    let pause = pauses.next().unwrap_or(Duration::from_secs(5)).min(Duration::from_secs(5));
                    tracing::warn!(
                        schema = self.schema.as_str(),
                        version = m.map(|m| m.version),
                        tries,
                        retry_in = ?pause,
                        "migration step let go of its locks after the lock timeout (the table is in use); retrying"
                    );
                    tokio::time::sleep(pause).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One try of a migration step, in one transaction.
    async fn migration_try(&self, conn: &mut PgConnection, m: Option<&Migration>) -> Result<()> {
        let s = self.schema.as_str();
        let mut tx = conn.begin().await?;
        // One migrator per schema at a time, across processes; released at commit. Waiting for
        // the other migrator blocks no traffic, so that wait has no lock timeout.
        sqlx::query("SELECT set_config('lock_timeout', '0', true), set_config('statement_timeout', '0', true)")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('brokerfence.migrate.' || $1, 0))")
            .bind(s.to_owned())
            .execute(&mut *tx)
            .await?;
        // Every lock on a fence table from here on: wait briefly, or let go and retry.
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(pg_ms(self.migration.lock_timeout).to_string())
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS {s}"))).execute(&mut *tx).await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {s}._migrations (version bigint PRIMARY KEY, name text NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )))
        .execute(&mut *tx)
        .await?;
        if let Some(m) = m {
            let applied: Option<i64> =
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {s}._migrations WHERE version = $1")))
                    .bind(m.version)
                    .fetch_optional(&mut *tx)
                    .await?;
            if applied.is_none() {
                for stmt in m.statements {
                    sqlx::query(AssertSqlSafe(render(stmt, &self.schema)))
                        .execute(&mut *tx)
                        .await
                        .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source })?;
                }
                sqlx::query(AssertSqlSafe(format!("INSERT INTO {s}._migrations (version, name) VALUES ($1, $2)")))
                    .bind(m.version)
                    .bind(m.name)
                    .execute(&mut *tx)
                    .await?;
                tracing::info!(schema = s, version = m.version, name = m.name, "applied migration");
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn claim_round(
        &self,
        queue: &QueueName,
        keys: &[String],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> Result<Vec<ClaimRow>> {
        Ok(sqlx::query_as::<_, ClaimRow>(sql(&self.stmts.claim))
            .bind(queue.as_str().to_owned())
            .bind(keys.to_vec())
            .bind(owner.as_str().to_owned())
            .bind(lease.as_millis_i64())
            .bind(self.max_claims)
            .fetch_all(&self.pool)
            .await?)
    }
}

type FencedRow = (i64, Option<String>, Option<i64>, Option<String>);

/// What one pruning transaction did: rows deleted, or nothing because another pruner held the
/// pruner lock (or claims kept the queue's floor lock for longer than the pruner waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PruneBatch {
    Deleted(u64),
    Contended,
}

/// How long a pruning batch waits for a queue's floor lock. Claims of the queue that come
/// meanwhile wait behind it, so this is short; a pruner that does not get it ends its run
/// (contended) and the next run tries again.
const FLOOR_LOCK_WAIT_MS: &str = "100";

impl PgFence {
    /// Begins a pruning transaction holding the schema's pruner lock, or `None` when another
    /// pruner holds it (never waits for it).
    async fn begin_prune(&self) -> Result<Option<sqlx::Transaction<'static, sqlx::Postgres>>> {
        let mut tx = self.pool.begin().await?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(format!("brokerfence.pruner.{}", self.schema.as_str()))
            .fetch_one(&mut *tx)
            .await?;
        if !got {
            tx.rollback().await?;
            return Ok(None);
        }
        Ok(Some(tx))
    }

    /// One batch of job pruning in its own transaction: the pruner lock, the queue's floor lock
    /// (exclusive, see migration 5), then one statement that deletes and raises the floor.
    async fn prune_jobs_batch(&self, queue: &QueueName, state: &str, age: Duration, batch: u32) -> Result<PruneBatch> {
        let Some(mut tx) = self.begin_prune().await? else { return Ok(PruneBatch::Contended) };
        sqlx::query("SELECT set_config('lock_timeout', $1, true)").bind(FLOOR_LOCK_WAIT_MS).execute(&mut *tx).await?;
        let floor_lock = sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(format!("brokerfence.floor.{}.{}", self.schema.as_str(), queue.as_str()))
            .execute(&mut *tx)
            .await;
        match floor_lock.map_err(FenceError::from) {
            Ok(_) => {}
            Err(FenceError::LockTimeout(_)) => {
                tx.rollback().await?;
                tracing::debug!(queue = %queue, "pruner did not get the queue's floor lock in time; stopping this run");
                return Ok(PruneBatch::Contended);
            }
            Err(e) => return Err(e),
        }
        let (n, floor): (i64, Option<i64>) = sqlx::query_as(sql(&self.stmts.prune_jobs))
            .bind(queue.as_str().to_owned())
            .bind(state.to_owned())
            .bind(crate::retention::age_ms(age))
            .bind(i64::from(batch))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        if n > 0 {
            tracing::debug!(queue = %queue, state, deleted = n, floor, "pruned a batch");
        }
        Ok(PruneBatch::Deleted(u64::try_from(n).unwrap_or(0)))
    }

    /// One batch of ledger pruning (receiver `scope`) in its own transaction, under the pruner
    /// lock: the rows deleted, or `None` when another pruner held the lock.
    async fn prune_ledger_batch(&self, scope: &str, age: Duration, batch: u32) -> Result<Option<u64>> {
        let Some(mut tx) = self.begin_prune().await? else { return Ok(None) };
        let done = sqlx::query(sql(&self.stmts.prune_ledger))
            .bind(scope.to_owned())
            .bind(crate::retention::age_ms(age))
            .bind(i64::from(batch))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(done.rows_affected()))
    }

    /// Prunes the ledger rows of `scope` older than `age`, batch after batch: (rows, batches,
    /// contended), contended when another pruner held the pruner lock (the run stopped there).
    pub(crate) async fn prune_ledger_scope(
        &self,
        scope: &str,
        age: Duration,
        batch: u32,
        pause: Duration,
    ) -> Result<(u64, u64, bool)> {
        let (mut rows, mut batches) = (0u64, 0u64);
        loop {
            match self.prune_ledger_batch(scope, age, batch).await? {
                None => return Ok((rows, batches, true)),
                Some(n) => {
                    rows += n;
                    if n > 0 {
                        batches += 1;
                    }
                    if n < u64::from(batch) {
                        return Ok((rows, batches, false));
                    }
                }
            }
            tokio::time::sleep(pause).await;
        }
    }

    async fn prune_all(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let mut report = crate::PruneReport::default();
        let batch = retention.batch();
        for (queue, state, age) in retention.targets() {
            loop {
                match self.prune_jobs_batch(queue, state, age, batch).await? {
                    PruneBatch::Contended => {
                        report.contended = true;
                        return Ok(report);
                    }
                    PruneBatch::Deleted(n) => {
                        if state == "completed" {
                            report.completed += n;
                        } else {
                            report.dead += n;
                        }
                        if n > 0 {
                            report.batches += 1;
                        }
                        if n < u64::from(batch) {
                            break;
                        }
                    }
                }
                tokio::time::sleep(retention.pause()).await;
            }
        }
        for (scope, age) in retention.ledger_scopes() {
            let (rows, batches, contended) = self.prune_ledger_scope(scope, age, batch, retention.pause()).await?;
            report.ledger += rows;
            report.batches += batches;
            if contended {
                report.contended = true;
                return Ok(report);
            }
        }
        Ok(report)
    }
}

/// A lock timeout, typed or inside a migration error.
fn is_lock_timeout(e: &FenceError) -> bool {
    match e {
        FenceError::LockTimeout(_) => true,
        FenceError::Migration { source: sqlx::Error::Database(db), .. } => db.code().as_deref() == Some("55P03"),
        _ => false,
    }
}
/// key, outcome/state, epoch, owner, lease_until ms, ttl ms, attempts, ms until run_at
type ClaimRow = (String, String, i64, Option<String>, Option<i64>, Option<i64>, i64, Option<i64>);

/// Runs a batched claim: one statement per round; a key whose row another claimer inserted
/// concurrently (invisible to this statement's snapshot) is asked again in the next round.
pub(crate) async fn claim_rounds<F, Fut>(
    queue: &QueueName,
    keys: &[JobKey],
    owner: &Owner,
    mut round: F,
) -> Result<Vec<Claim>>
where
    F: FnMut(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<ClaimRow>>>,
{
    let distinct = distinct_keys(keys);
    let mut outcomes: std::collections::HashMap<&str, Claim> = std::collections::HashMap::with_capacity(distinct.len());
    let mut todo: Vec<&JobKey> = distinct;
    for _ in 0..5 {
        if todo.is_empty() {
            break;
        }
        let asked: std::collections::HashMap<&str, &JobKey> = todo.iter().map(|k| (k.as_str(), *k)).collect();
        let rows = round(todo.iter().map(|k| k.as_str().to_owned()).collect()).await?;
        for row in &rows {
            if let Some(&k) = asked.get(row.0.as_str()) {
                let outcome = claim_outcome(queue, k, owner, row)?;
                // A key this statement claimed may also come back as it was in the statement's
                // snapshot (see the claim statement): the claim is what happened.
                match outcomes.get(k.as_str()) {
                    Some(Claim::Claimed(_)) => {}
                    _ => {
                        outcomes.insert(k.as_str(), outcome);
                    }
                }
            }
        }
        todo.retain(|k| !outcomes.contains_key(k.as_str()));
    }
    keys.iter()
        .map(|k| {
            outcomes
                .get(k.as_str())
                .cloned()
                .ok_or_else(|| FenceError::Corrupt(format!("claim of {k} found no row after 5 rounds")))
        })
        .collect()
}

#[async_trait]
impl FenceStore for PgFence {
    /// Applies the pending migrations online: each in its own short transaction that waits at
    /// most the migration lock timeout (200 ms by default) for its table locks, so that the
    /// exclusive lock a schema change asks for never sits in the lock queue holding up live
    /// claims, commits and heartbeats for longer than that; on a lock timeout it backs off and
    /// tries again (see [`PgFence::with_migration_lock_timeout`]). Migrations add columns with
    /// constant defaults (no table rewrite). The limit that remains: once granted, migration 2
    /// (byte-order keys) holds its exclusive lock while it rebuilds the indexes on the key
    /// columns, which takes time in proportion to the table (milliseconds for thousands of rows,
    /// seconds for millions); statements on the table wait that long. Migration 2 also changes
    /// the collation of the key columns, and workers of releases before this one return those
    /// columns from prepared statements: on each of their open connections those statements then
    /// fail with "cached plan must not change result type" until the connection is replaced, so
    /// stop (or restart) such workers around a migration from version 1. This release's
    /// statements return key columns as `COLLATE "C"` and are not affected.
    async fn migrate(&self) -> Result<()> {
        let s = self.schema.as_str();
        let mut conn = self.pool.acquire().await?;
        // Fast path, and the one a role without CREATE on the database takes: when every
        // migration is recorded already there is nothing to lock or create. A role that may not
        // read the record falls through and gets the database's permission error below.
        let recorded: std::result::Result<Vec<i64>, _> =
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {s}._migrations")))
                .fetch_all(&mut *conn)
                .await;
        if let Ok(applied) = recorded
            && MIGRATIONS.iter().all(|m| applied.contains(&m.version))
        {
            return Ok(());
        }
        // The schema and the record first (an empty step), then each migration.
        self.migration_step(&mut conn, None).await?;
        for m in MIGRATIONS {
            self.migration_step(&mut conn, Some(m)).await?;
        }
        Ok(())
    }

    async fn check_schema(&self) -> Result<()> {
        let s = self.schema.as_str();
        let found: std::result::Result<i64, sqlx::Error> =
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT coalesce(max(version), 0)::bigint FROM {s}._migrations")))
                .fetch_one(&self.pool)
                .await;
        let found = match found {
            Ok(v) => v,
            // 42P01 undefined_table, 3F000 invalid_schema_name: no schema yet.
            Err(sqlx::Error::Database(db)) if matches!(db.code().as_deref(), Some("42P01" | "3F000")) => 0,
            Err(e) => return Err(e.into()),
        };
        schema_verdict(found, REQUIRED_VERSION)
    }

    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> Result<Vec<Claim>> {
        claim_rounds(queue, keys, owner, |todo| async move { self.claim_round(queue, &todo, owner, lease).await }).await
    }

    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> Result<u64> {
        self.enqueue_on(&self.pool, queue, jobs).await
    }

    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> Result<Vec<ClaimedJob>> {
        type Row = (String, String, i64, Option<i64>, Option<i64>, i64, Option<Vec<u8>>, Option<Vec<u8>>);
        let rows: Vec<Row> = sqlx::query_as(sql(&self.stmts.claim_next))
            .bind(queue.as_str().to_owned())
            .bind(owner.as_str().to_owned())
            .bind(lease.as_millis_i64())
            .bind(i64::from(n))
            .bind(self.max_claims)
            .fetch_all(&self.pool)
            .await?;
        // Rows over the cap on claims were made dead, not claimed.
        rows.into_iter()
            .filter(|row| row.1 == "running")
            .map(|(key, _, epoch, lease_until, ttl, attempts, payload, progress)| {
                Ok(ClaimedJob {
                    lease: Lease {
                        queue: queue.clone(),
                        key: JobKey::new(key)?,
                        epoch,
                        owner: owner.clone(),
                        lease_until: DbTime(lease_until.unwrap_or(0)),
                        ttl: millis(ttl.unwrap_or(0)),
                        attempts,
                    },
                    payload: payload.unwrap_or_default(),
                    progress,
                })
            })
            .collect()
    }

    /// Never waits on a row lock: see [`Heartbeat::held`].
    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        self.renew(leases, lease).await
    }

    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> Result<()> {
        self.fenced_write(&self.pool, &self.stmts.checkpoint, lease, |q| q.bind(progress.to_vec())).await.map(drop)
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<()> {
        self.fenced_write(&self.pool, &self.stmts.complete, lease, |q| q.bind(result.to_vec())).await.map(drop)
    }

    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> Result<Vec<Result<()>>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        // A key twice in one statement would make the UPDATE ambiguous: batch the first of each,
        // send any repeat on its own.
        let mut seen = std::collections::HashSet::with_capacity(items.len());
        let (first, repeats): (Vec<usize>, Vec<usize>) =
            (0..items.len()).partition(|&i| seen.insert((items[i].0.queue.as_str(), items[i].0.key.as_str())));
        let pick = |f: fn(&(Lease, Vec<u8>)) -> String| first.iter().map(|&i| f(&items[i])).collect::<Vec<String>>();
        let rows: Vec<(String, String, bool, Option<i64>, Option<String>)> =
            sqlx::query_as(sql(&self.stmts.complete_batch))
                .bind(pick(|(l, _)| l.queue.as_str().to_owned()))
                .bind(pick(|(l, _)| l.key.as_str().to_owned()))
                .bind(pick(|(l, _)| l.owner.as_str().to_owned()))
                .bind(first.iter().map(|&i| items[i].0.epoch).collect::<Vec<i64>>())
                .bind(first.iter().map(|&i| items[i].1.clone()).collect::<Vec<Vec<u8>>>())
                .fetch_all(&self.pool)
                .await?;
        // Per item: whether it was committed, and the epoch and owner of the row it locked.
        let mut verdicts: std::collections::HashMap<(&str, &str), (bool, Option<(Option<i64>, &Option<String>)>)> =
            std::collections::HashMap::with_capacity(first.len());
        for (queue, key, committed, epoch, owner) in &rows {
            let v = verdicts.entry((queue.as_str(), key.as_str())).or_default();
            if *committed {
                v.0 = true;
            } else {
                v.1 = Some((*epoch, owner));
            }
        }
        let mut out: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        for &i in &first {
            let lease = &items[i].0;
            out[i] = Some(match verdicts.get(&(lease.queue.as_str(), lease.key.as_str())) {
                Some((true, _)) => Ok(()),
                Some((false, Some((epoch, owner)))) => Err(FenceError::Fenced {
                    key: lease.key.as_str().to_owned(),
                    epoch: lease.epoch,
                    current_epoch: epoch.unwrap_or(0),
                    current_owner: (*owner).clone(),
                }),
                _ => Err(FenceError::Corrupt(format!("batch completion returned no row for {}", lease.key))),
            });
        }
        for &i in &repeats {
            out[i] = Some(match self.complete(&items[i].0, &items[i].1).await {
                Err(e) if !e.is_fenced() => return Err(e),
                other => other,
            });
        }
        Ok(out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(FenceError::Corrupt("missing batch answer".into()))))
            .collect())
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> Result<FailOutcome> {
        let (base_ms, max_ms) = backoff_ms(policy);
        let error: String = error.replace('\0', "\u{FFFD}");
        let answer = self
            .fenced_write(&self.pool, &self.stmts.fail, lease, |q| {
                q.bind(retry).bind(policy.max_attempts).bind(base_ms).bind(error).bind(max_ms)
            })
            .await?;
        fail_outcome(answer.as_deref().unwrap_or_default())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced_write(&self.pool, &self.stmts.release, lease, |q| q).await.map(drop)
    }

    async fn job(&self, queue: &QueueName, key: &JobKey) -> Result<Option<JobRecord>> {
        let (pool, statement) = (self.pool.clone(), sql(&self.stmts.job));
        let (q, k) = (queue.as_str().to_owned(), key.as_str().to_owned());
        let row: Option<JobRow> =
            detached(async move { Ok(sqlx::query_as(statement).bind(q).bind(k).fetch_optional(&pool).await?) }).await?;
        row.map(|row| job_record(queue, key, row)).transpose()
    }

    /// One statement for every lease.
    async fn completed_under(&self, leases: &[Lease]) -> Result<Vec<bool>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let (queues, keys, epochs, owners) = lease_columns(leases);
        let (pool, statement) = (self.pool.clone(), sql(&self.stmts.completed_under));
        let rows: Vec<(i64, bool)> = detached(async move {
            Ok(sqlx::query_as(statement).bind(queues).bind(keys).bind(epochs).bind(owners).fetch_all(&pool).await?)
        })
        .await?;
        let mut out = vec![false; leases.len()];
        for (i, completed) in rows {
            let slot = usize::try_from(i - 1).ok().and_then(|i| out.get_mut(i));
            match slot {
                Some(slot) => *slot = completed,
                None => return Err(FenceError::Corrupt(format!("completed_under answered for item {i}"))),
            }
        }
        Ok(out)
    }

    async fn prune(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let span = tracing::info_span!("fence.prune", backend = "postgres", schema = self.schema.as_str());
        let started = std::time::Instant::now();
        let report = self.prune_all(retention).instrument(span.clone()).await?;
        span.in_scope(|| tracing::info!(?report, elapsed = ?started.elapsed(), "prune run"));
        Ok(report)
    }

    async fn db_now(&self) -> Result<DbTime> {
        let ms: i64 = sqlx::query_scalar(concat!("SELECT ", ms!("clock_timestamp()"))).fetch_one(&self.pool).await?;
        Ok(DbTime(ms))
    }

    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn concrete(&self) -> crate::Backend<'_> {
        crate::Backend::Postgres(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str, outcome: &str, epoch: i64) -> ClaimRow {
        (key.to_owned(), outcome.to_owned(), epoch, Some("other".to_owned()), Some(0), Some(1_000), 1, Some(0))
    }

    /// A key the statement claimed can also come back as its snapshot showed it (running under
    /// another owner whose lease ran out meanwhile): whichever row comes first, the claim stands,
    /// or this worker would hold a lease it does not know of.
    #[tokio::test]
    async fn a_claimed_row_wins_over_the_snapshot_row_of_the_same_key() {
        let (q, k, me) = (QueueName::new("q").unwrap(), JobKey::new("k").unwrap(), Owner::new("me").unwrap());
        for rows in
            [vec![row("k", "claimed", 2), row("k", "running", 1)], vec![row("k", "running", 1), row("k", "claimed", 2)]]
        {
            let out = claim_rounds(&q, std::slice::from_ref(&k), &me, |_| {
                let rows = rows.clone();
                async move { Ok(rows) }
            })
            .await
            .unwrap();
            assert!(matches!(&out[..], [Claim::Claimed(l)] if l.epoch == 2), "{out:?}");
        }
    }
}
