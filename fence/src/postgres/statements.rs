//! The fence statements, rendered once per schema and set of guards, and the helpers they share.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

use crate::error::{FenceError, Result};
use crate::guards::Guards;
use crate::lease::Lease;
use crate::schema::SchemaName;
use crate::wake;

/// The statements, rendered once for a schema and a set of guards.
///
/// Every text column they return that comes from a key column carries `COLLATE "C"`: the result
/// type of a prepared statement then stays the same whatever the collation of the column
/// (migration 2 changed it). A prepared statement whose result type changes under it fails with
/// "cached plan must not change result type" on every later run on that connection.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(super) claim: Arc<str>,
    pub(super) enqueue: Arc<str>,
    pub(super) enqueue_notify: Arc<str>,
    pub(super) next_due: Arc<str>,
    pub(super) claim_next: Arc<str>,
    pub(super) heartbeat: Arc<str>,
    pub(super) checkpoint: Arc<str>,
    pub(super) complete: Arc<str>,
    pub(super) fail: Arc<str>,
    pub(super) release: Arc<str>,
    pub(super) dead_key: Arc<str>,
    pub(super) complete_batch: Arc<str>,
    pub(super) job: Arc<str>,
    pub(super) completed_under: Arc<str>,
    pub(crate) ledger_accept: Arc<str>,
    pub(crate) ledger_current: Arc<str>,
    pub(super) prune_jobs: Arc<str>,
    pub(crate) prune_ledger: Arc<str>,
}

/// Raised on the caller's connection after a fenced [`PgFence::complete_in`]: the transaction is
/// aborted, so the caller's rows cannot commit (SQLSTATE BF409).
pub(super) const ABORT_FENCED_TX: &str = "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'BF409', \
    MESSAGE = 'brokerfence: complete_in was fenced (a newer epoch holds the job); this transaction cannot commit'; END $$";

/// The epoch base of the server's current timeline, `(timeline - 1) × 2^32`, read once per
/// statement (an init plan): 0 on a server that was never promoted (timeline 1), so epochs there
/// are what they always were. The timeline is the first 8 hex digits of the name of the WAL file
/// being written; that name changes the moment a promoted server starts writing (the control
/// file's `pg_control_checkpoint()` still names the old timeline until the next checkpoint).
/// `pg_walfile_name` fails on a server in recovery, so a claim never runs there. The
/// multiplication (not a shift) fails with "bigint out of range" instead of wrapping, past
/// timeline 2^31. See [`crate::epoch`].
pub(super) const TIMELINE_BASE: &str = "(SELECT (('x' || left(pg_walfile_name(pg_current_wal_insert_lsn()), 8))\
    ::bit(32)::bigint - 1) * 4294967296)";

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
/// The new epoch is the row's plus one, and at least the server's timeline base plus one
/// (`base`, [`TIMELINE_BASE`]): the first claim of a job on a promoted server jumps above every
/// epoch of the timeline the server left.
///
/// A row never claimed (`attempts = 0`: enqueued, or released before its first claim counted)
/// starts above the queue's epoch floor too (`floor`, read once per statement, under the floor
/// lock, in a short fence transaction): an enqueue does not read the floor, so that it takes no
/// lock the pruner waits for until the caller's COMMIT (issue #30, item 8). That is enough: a
/// key's old row is deleted, with the floor raised, before an enqueue can insert the key again
/// (the insert waits for a delete in progress), and the claim reads the floor after that.
///
/// A claim that makes the job running changes no indexed column (migration 8): it is a HOT
/// update, with no index entry written (`finished` stays NULL).
///
/// A claim that makes the job running leaves `updated_at` as it was (nothing reads it on a
/// running row; the pruner ages finished rows by it, set when they finish), a claim that makes it
/// dead sets it. That is WAL: a claimed row's new version is logged from its first changed
/// byte to its last, and `updated_at` is the last column but one, so a claim that set it logged
/// `run_at`, the payload and `created_at` as well (24-34 bytes per claim in
/// `tests/runtime/throughput_cost.rs` with a 7-byte payload; a larger payload adds its size).
fn capped_claim(owner: &str, lease_end: &str, cap: &str, inc: &str, base: &str, floor: &str) -> String {
    let over = format!("t.attempts >= {cap}::bigint");
    format!(
        "state = CASE WHEN {over} THEN 'dead' ELSE 'running' END, \
         finished = CASE WHEN {over} THEN 'dead' ELSE t.finished END, \
         epoch = CASE WHEN {over} THEN t.epoch ELSE greatest(t.epoch + {inc}, {base} + {inc}, \
           CASE WHEN t.attempts = 0 THEN {floor} + {inc} ELSE 0 END) END, \
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
        // The schema's notification channel: lowercase letters, digits, `_` and `.` only.
        let chan = wake::channel(s);
        let inc = if guards.epoch_increment { "1" } else { "0" };
        let base = if guards.timeline_epochs { TIMELINE_BASE } else { "0" };
        let cas = if guards.commit_cas { CAS } else { NO_CAS };
        let hb_cas = if guards.heartbeat_cas {
            "c.cur_epoch = c.epoch AND c.cur_owner = c.owner AND c.cur_state = 'running'"
        } else {
            "true"
        };
        let (hb_epoch, hb_owner) = if guards.heartbeat_cas { ("t.epoch", "t.owner") } else { ("c.epoch", "c.owner") };
        // Newer wins; an equal epoch is the same claim retrying unless both calls name owners
        // and they differ (a token handed out twice: refused, see `crate::ledger`).
        let ledger_where = match (guards.ledger_check, guards.ledger_owner_check) {
            (false, _) => "",
            (true, false) => "WHERE l.epoch <= EXCLUDED.epoch",
            (true, true) => {
                "WHERE l.epoch < EXCLUDED.epoch OR (l.epoch = EXCLUDED.epoch \
                 AND (l.owner IS NULL OR EXCLUDED.owner IS NULL OR l.owner = EXCLUDED.owner))"
            }
        };
        let lease_end = "clock_timestamp() + $LEASE::bigint * interval '1 millisecond'";
        // The queue's epoch floor for a row's first claim ($1 is the queue in both claims).
        let floor = format!("(SELECT {s}.epoch_floor($1))");
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
               SELECT $1, i.key, 'running', greatest((SELECT {s}.epoch_floor($1)), {base}) + 1, $3, {lease}, 1, \
                   clock_timestamp() \
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
            capped = capped_claim("EXCLUDED.owner", &lease_end.replace("$LEASE", "$4"), "$5", inc, base, &floor),
            lu = ms!("c.lease_until"),
            ttl = ms!("(c.lease_until - clock_timestamp())"),
            ra = ms!("(c.run_at - clock_timestamp())"),
            tlu = ms!("t.lease_until"),
            tttl = ms!("(t.lease_until - clock_timestamp())"),
            tra = ms!("(t.run_at - clock_timestamp())"),
        );
        // Epoch 0 and no floor read: the row's first claim starts above the floor (see
        // `capped_claim`), so an enqueue inside a caller's long transaction holds no floor lock
        // the pruner would wait for (issue #30, item 8).
        // Answers (jobs inserted, 0). The fence's own enqueue announces the jobs after its commit
        // (`crate::wake`); an enqueue in the caller's transaction uses `enqueue_notify`.
        let enqueue = format!(
            "WITH ins AS (INSERT INTO {s}.jobs (queue, key, state, epoch, payload, run_at, traceparent, tracestate) \
                 SELECT $1, u.k, 'pending', 0, u.p, clock_timestamp(), $4, $5 \
                 FROM unnest($2::text[], $3::bytea[]) AS u(k, p) \
                 ON CONFLICT (queue, key) DO NOTHING RETURNING 1) \
             SELECT count(*)::bigint, 0::bigint FROM ins"
        );
        // The same inside the caller's transaction, with the notification (see `crate::wake`):
        // sent once per statement that inserted a job, when the caller's transaction commits,
        // so a rolled-back enqueue wakes nobody. The `woke` CTE runs because the answer counts
        // it. Answers (jobs inserted, notifications sent).
        let enqueue_notify = format!(
            "WITH ins AS (INSERT INTO {s}.jobs (queue, key, state, epoch, payload, run_at, traceparent, tracestate) \
                 SELECT $1, u.k, 'pending', 0, u.p, clock_timestamp(), $4, $5 \
                 FROM unnest($2::text[], $3::bytea[]) AS u(k, p) \
                 ON CONFLICT (queue, key) DO NOTHING RETURNING 1), \
             n AS (SELECT count(*)::bigint AS n FROM ins), \
             woke AS (SELECT pg_notify('{chan}', {payload}) FROM n WHERE n.n > 0) \
             SELECT (SELECT n.n FROM n), (SELECT count(*)::bigint FROM woke)",
            payload = wake::payload_sql("$1", "0"),
        );
        // When the earliest job of a queue waiting to become due is due ($1 queue), in ms from
        // now: by `jobs_open`, from the first `run_at` after now (running rows, whose `run_at`
        // is in the past, are not read).
        let next_due = format!(
            "SELECT {ra} FROM {s}.jobs t WHERE t.queue = $1 AND t.finished IS NULL \
             AND t.run_at > (SELECT clock_timestamp()) AND t.state IN ('pending', 'failed') \
             ORDER BY t.run_at LIMIT 1",
            ra = ms!("(t.run_at - clock_timestamp())"),
        );
        // One scan of `jobs_open` in `run_at` order takes due jobs and jobs whose lease ran out
        // alike: a running row stays in that index (its claim was a HOT update, migration 8), so
        // the scan reads past the running rows that still hold their lease (the filter) between
        // its start (the claim cursor, not the queue's start) and the first due job, then locks
        // what it takes, skipping rows another transaction holds. A row changed since the
        // statement's snapshot (claimed meanwhile) is checked again in its newest version when
        // locked, and left out when it no longer qualifies. `(SELECT clock_timestamp())` is
        // read once per statement (an init plan), so the time bound on `run_at` is an index
        // condition that ends the scan at the first job not yet due. `$6` is the claim cursor's
        // lower bound on `run_at` (microseconds since the Unix epoch; NULL scans from the
        // start), also an index condition: see [`ClaimCursors`](super::cursor::ClaimCursors).
        // Each row answers its `run_at` in microseconds, for the cursor.
        let claim_next = format!(
            "WITH pick AS (SELECT queue, key FROM {s}.jobs WHERE queue = $1 AND finished IS NULL \
                 AND run_at <= (SELECT clock_timestamp()) \
                 AND run_at >= COALESCE('epoch'::timestamptz + $6::bigint * interval '1 microsecond', \
                     '-infinity'::timestamptz) \
                 AND (state IN ('pending', 'failed') OR lease_until < (SELECT clock_timestamp())) \
                 ORDER BY run_at LIMIT $4 FOR UPDATE SKIP LOCKED) \
             UPDATE {s}.jobs t SET {capped} \
             FROM pick WHERE t.queue = pick.queue AND t.key = pick.key \
             RETURNING t.key COLLATE \"C\", t.state, t.epoch, {tlu}, {tttl}, t.attempts, t.payload, t.progress, \
                 floor(extract(epoch from t.run_at) * 1000000)::bigint, left(t.traceparent, 64), left(t.tracestate, 513)",
            capped = capped_claim("$2", &lease_end.replace("$LEASE", "$3"), "$5", inc, base, &floor),
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
        let batch_cas =
            if guards.commit_cas { "t.owner = u.owner AND t.epoch = u.epoch AND t.state = u.running" } else { "true" };
        // The compare-and-set is the UPDATE's own condition, so a row is locked only when it is
        // committed (in (queue, key) order: the nested loop follows the sorted input, the order
        // batch claims lock in). Locking every row first (`SELECT … FOR UPDATE`) and updating
        // the matching ones after logged a row lock per commit on top of the update (issue #18:
        // 56 bytes of WAL per job where the new row version fits on its page; where it does not,
        // PostgreSQL logs such a lock as part of the update anyway). A row changed meanwhile is compared again in its newest
        // version (READ COMMITTED re-checks the WHERE of an UPDATE on the row it waited for).
        // The state is compared with a column of `u`, not the constant: with `state = 'running'`
        // the planner could prove the predicate of `jobs_leased` (an index of the schema before
        // migration 8) and probe that index by queue alone, reading every running row of the
        // queue per item (110 µs of PostgreSQL CPU per job instead of 30 at concurrency 128).
        //
        // One row per committed item: its ordinal. The statement reads each item's row once (the
        // UPDATE's probe); [`PgFence::complete_batch`] reads again only the items it refused, to
        // name their holders. It used to answer one row per item, committed or not, with the
        // epoch, owner and state its snapshot saw: a union of the items with the updated rows,
        // grouped by ordinal, and a lookup joined to it. That cost 1.5–2 µs of PostgreSQL CPU per
        // job for an answer needed only by refused items (issue #18: the commits of a bench drain
        // at concurrency 128, 11.1–11.6 → 9.6–9.8 µs per job, against 6.7–7.3 for the plain
        // loop's `UPDATE … WHERE key = ANY`; docs/performance.md).
        let complete_batch = format!(
            "WITH u AS (SELECT *, 'running'::text AS running \
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bytea[]) WITH ORDINALITY \
                 AS u(queue, key, owner, epoch, result, i)) \
             UPDATE {s}.jobs t SET state = 'completed', finished = 'completed', result = u.result, \
                 lease_until = NULL, \
                 updated_at = clock_timestamp() FROM (SELECT * FROM u ORDER BY queue, key) u \
             WHERE t.queue = u.queue AND t.key = u.key AND {batch_cas} RETURNING u.i"
        );
        let checkpoint = fenced(
            s,
            &format!("UPDATE {s}.jobs t SET progress = $5, updated_at = clock_timestamp() WHERE {cas}"),
            "''::text AS r",
        );
        let complete = fenced(
            s,
            &format!(
                "UPDATE {s}.jobs t SET state = 'completed', finished = 'completed', result = $5, \
                 lease_until = NULL, updated_at = clock_timestamp() WHERE {cas}"
            ),
            "''::text AS r",
        );
        let fail = fenced(
            s,
            &format!(
                "UPDATE {s}.jobs t SET state = CASE WHEN $5 AND t.failures + 1 < $6 THEN 'failed' ELSE 'dead' END, \
                 finished = CASE WHEN $5 AND t.failures + 1 < $6 THEN NULL ELSE 'dead' END, \
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
        // A row a claim took whose key `JobKey` refuses (issue #30): dead under the claim's own
        // lease, with the reason ($5). The key CHECK (migration 11) spares dead rows.
        let dead_key = fenced(
            s,
            &format!(
                "UPDATE {s}.jobs t SET state = 'dead', finished = 'dead', last_error = $5, lease_until = NULL, \
                 updated_at = clock_timestamp() WHERE {CAS}"
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
            "INSERT INTO {s}.ledger AS l (scope, job, epoch, owner) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (scope, job) DO UPDATE SET epoch = EXCLUDED.epoch, \
             owner = CASE WHEN l.epoch = EXCLUDED.epoch THEN coalesce(l.owner, EXCLUDED.owner) ELSE EXCLUDED.owner END, \
             updated_at = clock_timestamp() \
             {ledger_where} RETURNING l.epoch"
        );
        let ledger_current = format!("SELECT epoch, owner FROM {s}.ledger WHERE scope = $1 AND job = $2");
        // One batch of pruning ($1 queue, $2 state, $3 age in ms, $4 rows): the oldest finished
        // rows by the `jobs_finished` index (queue, finished, updated_at), rows another
        // transaction holds skipped, deleted by their row address (a tid scan: the rows are
        // locked, so their addresses hold), and the
        // queue's epoch floor raised to the highest epoch deleted, all in one statement. Answers
        // the rows deleted and the floor (NULL when nothing was deleted). The cutoff is on the
        // database clock at the start of the statement (`statement_timestamp()`, stable, so it is
        // an index condition: the scan stops at the cutoff instead of filtering past it).
        let prune_jobs = format!(
            "WITH victims AS (SELECT t.ctid AS id FROM {s}.jobs t WHERE t.queue = $1 \
                 AND t.finished IS NOT NULL AND t.finished = $2 \
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
            enqueue_notify: enqueue_notify.into(),
            next_due: next_due.into(),
            claim_next: claim_next.into(),
            heartbeat: heartbeat.into(),
            checkpoint: checkpoint.into(),
            complete: complete.into(),
            fail: fail.into(),
            release: release.into(),
            dead_key: dead_key.into(),
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
pub(super) async fn detached<T: Send + 'static>(
    statement: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => runtime.spawn(statement).await.map_err(|e| FenceError::StatementAborted(e.to_string()))?,
        Err(_) => statement.await,
    }
}

/// The identity columns of `leases` (queue, key, epoch, owner), as arrays for `unnest`.
pub(super) fn lease_columns(leases: &[Lease]) -> (Vec<String>, Vec<String>, Vec<i64>, Vec<String>) {
    let mut columns = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for l in leases {
        columns.0.push(l.queue.as_str().to_owned());
        columns.1.push(l.key.as_str().to_owned());
        columns.2.push(l.epoch);
        columns.3.push(l.owner.as_str().to_owned());
    }
    columns
}

pub(super) fn sql(s: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    // Every statement is rendered from constant text plus the validated schema name.
    AssertSqlSafe(Arc::clone(s))
}
