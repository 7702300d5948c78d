//! The embedded PostgreSQL migrations and the online, lock-bounded way `migrate` applies them.
//!
//! A migration is a list of [`Step`]s. A step that changes the catalog is a short transaction
//! that asks for its table locks under the migration lock timeout and lets go and retries (with
//! backoff) when it does not get them in time, so a live claim, heartbeat or commit never waits
//! behind it for longer than that timeout plus the milliseconds of the catalog change. Work that
//! takes time in proportion to the table never holds a lock that writes wait for (issue #30):
//! indexes are built and dropped CONCURRENTLY, a backfill runs in batches of its own
//! transactions, a CHECK is added NOT VALID and validated apart. Every step is idempotent, so a
//! migration interrupted anywhere (a crash, a failed index build) is run again from its first
//! step; the migration is recorded in `_migrations` (version and name, as before) only when its
//! last step is done. Migrations a schema recorded under an earlier build, in whatever steps
//! they ran then, are not run again. The list is here; [`apply`] runs it.

/// One PostgreSQL migration: its steps use `{s}` where the schema name goes.
pub(super) struct PgMigration {
    pub version: i64,
    pub name: &'static str,
    pub steps: &'static [Step],
}

/// One step of a migration (see the module's documentation). Each is idempotent.
pub(super) enum Step {
    /// Statements in one transaction, under the migration lock timeout: catalog changes, and
    /// reads of the table under locks writes do not wait for (`VALIDATE CONSTRAINT`).
    Tx(&'static [&'static str]),
    /// A backfill in batches of [`BACKFILL_BATCH`] rows in primary-key order, each batch a
    /// transaction of its own under the migration lock timeout. The statement takes the batch's
    /// lower bound (`$1` queue, `$2` key; `{after}` is where the comparison goes, inclusive for
    /// the first batch) and the batch size (`$3`), and answers the last (queue, key) of the
    /// batch, or no row past the table's end.
    Backfill(&'static str),
    /// An index built with `CREATE INDEX CONCURRENTLY` (no transaction; SHARE UPDATE EXCLUSIVE
    /// on the table, which claims, heartbeats and commits do not wait for). `create` is the
    /// statement; `shape` is a piece of the definition `pg_get_indexdef` gives for the index
    /// this build wants. An index of that name that is invalid (a build that failed or was
    /// interrupted leaves one) or of another shape (an earlier build's) is dropped first.
    Index { name: &'static str, table: &'static str, create: &'static str, shape: &'static str },
    /// An index of a table dropped with `DROP INDEX CONCURRENTLY` (no transaction), or in a step's
    /// transaction when the table is small (see `build_if_small`).
    DropIndex { name: &'static str, table: &'static str },
}

/// Rows per batch of a [`Step::Backfill`]: tens of milliseconds of row locks per batch.
pub(super) const BACKFILL_BATCH: i64 = 10_000;

/// Below this many rows an index is built in a step's transaction (see `build_if_small`).
const SMALL_TABLE: i64 = 10_000;

/// How many times an index step builds before it gives up on an index that never comes out valid
/// and of the shape it wants (a build another migrator runs at the same time counts as one).
const INDEX_BUILDS: u32 = 5;

/// Migration 5's steps: see its comment.
const MIGRATION_5: &[Step] = &[
    Step::Tx(&[
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
    ]),
    Step::Index {
        name: "ledger_age",
        table: "ledger",
        create: "CREATE INDEX CONCURRENTLY IF NOT EXISTS ledger_age ON {s}.ledger (scope, updated_at)",
        shape: "(scope, updated_at)",
    },
];

/// Migration 8's steps: see its comment.
const MIGRATION_8: &[Step] = &[
    Step::Tx(&[
        "ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS finished text",
        // Added once: dropped and added again, a CHECK validated by an earlier try would have to
        // be validated again.
        "DO $$ BEGIN
           IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = '{s}.jobs'::regclass
               AND conname = 'jobs_finished_is_final_state') THEN
             ALTER TABLE {s}.jobs ADD CONSTRAINT jobs_finished_is_final_state CHECK
               (finished IS NOT DISTINCT FROM (CASE WHEN state IN ('completed', 'dead') THEN state END)) NOT VALID;
           END IF;
         END $$",
        "ALTER TABLE {s}.jobs SET (fillfactor = 40)",
    ]),
    Step::Backfill(
        "WITH batch AS (SELECT t.queue, t.key FROM {s}.jobs t WHERE (t.queue, t.key) {after} ($1, $2) \
             ORDER BY t.queue, t.key LIMIT $3), \
         upd AS (UPDATE {s}.jobs t SET finished = t.state FROM batch b \
             WHERE t.queue = b.queue AND t.key = b.key AND t.state IN ('completed', 'dead') \
             AND t.finished IS DISTINCT FROM t.state) \
         SELECT b.queue COLLATE \"C\", b.key COLLATE \"C\" FROM batch b ORDER BY b.queue DESC, b.key DESC LIMIT 1",
    ),
    Step::Tx(&["ALTER TABLE {s}.jobs VALIDATE CONSTRAINT jobs_finished_is_final_state"]),
    Step::Index {
        name: "jobs_open",
        table: "jobs",
        create: "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_open ON {s}.jobs (queue, run_at) WHERE finished IS NULL",
        shape: "(queue, run_at) WHERE (finished IS NULL)",
    },
    // An earlier build's migration 5 made a `jobs_finished` on (queue, state, updated_at): the
    // shape tells it apart, and it is replaced.
    Step::Index {
        name: "jobs_finished",
        table: "jobs",
        create: "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_finished ON {s}.jobs (queue, finished, updated_at) \
                 WHERE finished IS NOT NULL",
        shape: "(queue, finished, updated_at) WHERE (finished IS NOT NULL)",
    },
    Step::DropIndex { name: "jobs_due", table: "jobs" },
    Step::DropIndex { name: "jobs_leased", table: "jobs" },
];

/// Migration 11: makes the open rows whose key breaks `JobKey`'s rules dead, with the reason.
/// A read of the whole table that locks only the rows it changes (nothing else waits for it).
const DEAD_BAD_KEYS: &str = "UPDATE {s}.jobs SET state = 'dead', finished = 'dead', lease_until = NULL, \
     updated_at = clock_timestamp(), last_error = 'not a valid job key (' || \
       CASE WHEN key = '' THEN 'must not be empty' \
       ELSE octet_length(key)::text || ' bytes is over the limit of 1024' END || \
       '): made dead by migration 11, which adds the schema''s CHECK on job keys' \
     WHERE state NOT IN ('completed', 'dead') AND NOT (key <> '' AND octet_length(key) <= 1024)";

// Migration 11's CHECK and `DEAD_BAD_KEYS` spell the key length limit out.
const _: () = assert!(crate::key::MAX_KEY_BYTES == 1024, "migration 11 checks keys of at most 1024 bytes");

pub(super) const MIGRATIONS: &[PgMigration] = &[
    PgMigration {
        version: 1,
        name: "jobs and ledger",
        // The column order is WAL (issue #18). PostgreSQL logs a row version updated on its own
        // page from the first byte that changed to the last, so the columns a claim changes
        // (lease_until, state, epoch, attempts, owner) sit together, right after the ones a
        // commit changes (updated_at, result, lease_until, state), and the ones neither touches
        // come first. In the order of the columns' meaning (state, epoch, owner, lease_until,
        // attempts, run_at, payload, ..., updated_at) a claim and a commit each logged most of
        // the row: 743-762 bytes of WAL per job against 689-702 in this order
        // (`tests/runtime/throughput_cost.rs`; `failures`, added by migration 3, comes last either way).
        // No statement depends on the order: every one names its columns, so a schema created in
        // the former order works the same and keeps it (a rewrite of the table is not worth its
        // lock). `finished` (migration 8) sits with the columns a commit changes; a schema created
        // before it has the column at the end.
        steps: &[Step::Tx(&[
            "CREATE TABLE {s}.jobs (
            queue       text        NOT NULL,
            key         text        NOT NULL,
            run_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
            created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            payload     bytea,
            progress    bytea,
            last_error  text,
            updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            result      bytea,
            finished    text,
            lease_until timestamptz,
            state       text        NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'running', 'completed', 'failed', 'dead')),
            epoch       bigint      NOT NULL DEFAULT 0 CHECK (epoch >= 0),
            attempts    bigint      NOT NULL DEFAULT 0,
            owner       text,
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
        ])],
    },
    PgMigration {
        version: 2,
        name: "byte-order keys",
        // Queue names, job keys and ledger scopes are opaque identifiers: compared byte by byte, every
        // primary-key probe and index insert skips the locale's string collation (`strcoll`). Under
        // C.UTF-8 that took 5-6 % off a statement of ten keys (claim 0.301 -> 0.285 ms, commit
        // 0.318 -> 0.299 ms, the two forms interleaved in one pgbench run); en_US.UTF-8 collates
        // at a higher cost still. A collation change rebuilds the indexes on these columns, not
        // the table.
        steps: &[Step::Tx(&[
            "ALTER TABLE {s}.jobs ALTER COLUMN queue TYPE text COLLATE \"C\", ALTER COLUMN key TYPE text COLLATE \"C\"",
            "ALTER TABLE {s}.ledger ALTER COLUMN scope TYPE text COLLATE \"C\", ALTER COLUMN job TYPE text COLLATE \"C\"",
        ])],
    },
    PgMigration {
        version: 3,
        name: "failures apart from claims",
        // A constant default: a catalog change only (no table rewrite), under a lock held for
        // milliseconds.
        steps: &[Step::Tx(&["ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS failures bigint NOT NULL DEFAULT 0"])],
    },
    PgMigration {
        version: 4,
        name: "outbox",
        // A new table and its index: nothing existing is locked beyond the schema's catalog (see
        // `crate::outbox`). The partial index serves the relay's "unsent, in id order" claim and
        // stays as small as the backlog.
        steps: &[Step::Tx(crate::outbox::MIGRATION)],
    },
    PgMigration {
        version: 5,
        name: "retention and epoch floors",
        // A new table, a function and the ledger's index for the pruner (`ledger_age`, per
        // receiver scope), built CONCURRENTLY (issue #30: a plain build held a SHARE lock, so
        // writes waited for the whole build, seconds on a table of millions). The jobs' index
        // for the pruner is migration 8's `jobs_finished`: this migration built one of that name
        // on (queue, state, updated_at) that migration 8 then replaced, a second read of the
        // whole jobs table for nothing, so it no longer builds it (a schema that has it from an
        // earlier build gets it replaced by migration 8 all the same).
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
        steps: MIGRATION_5,
    },
    PgMigration {
        version: 6,
        name: "room on the page for claims and commits",
        // Issue #18, the fence's WAL per job. Every claim and every commit writes a new version of
        // the job row. With the pages packed full by `enqueue_many` (the default fillfactor, 100)
        // the claims of a page put most new versions on another page: PostgreSQL then logs an
        // extra lock record for the old version and the whole new row (two pages referenced, no
        // prefix/suffix compression). With 30 % of each page kept free the new version stays on
        // its page, and the record holds only the bytes that changed: 25-35 bytes of WAL less per
        // claim (`tests/runtime/throughput_cost.rs`, 2,000 jobs in claims of 10: 412.7 -> 387.6 bytes per
        // job, or 389.0 -> 353.7 with claims that leave `updated_at`); commits measured the same
        // either way (the claim's dead version is pruned first). See docs/performance.md.
        //
        // A storage parameter: a catalog change under a SHARE UPDATE EXCLUSIVE lock (reads and
        // writes go on; only other schema changes and VACUUM wait), no table rewrite. It applies
        // to pages filled from then on; pages filled before keep their rows until they are
        // updated or vacuumed. The cost is disk: a backlog of pending jobs takes about 1/0.7 =
        // 1.4 times the pages it took.
        steps: &[Step::Tx(&["ALTER TABLE {s}.jobs SET (fillfactor = 70)"])],
    },
    PgMigration {
        version: 7,
        name: "the epoch trigger runs only when an epoch would go down",
        // Issue #18, the fence's CPU per job. Every claim raises an epoch, so the row trigger of
        // migration 1 ran a PL/pgSQL call per claimed row only to find the epoch had gone up. With
        // the comparison as the trigger's WHEN condition the executor checks it without a
        // function call, and the function runs (and raises) only for an update that would lower
        // an epoch: the same guard, about 1 µs less per claimed row (200,000 rows raised in one
        // statement, interleaved: 6.2-7.2 µs per row with the call, 5.8-6.3 µs with WHEN, 5.2-5.8
        // µs with no trigger). Dropping and creating the trigger in one transaction: no update
        // runs in between without it.
        steps: &[Step::Tx(&[
            "DROP TRIGGER IF EXISTS jobs_epoch_never_decreases ON {s}.jobs",
            "CREATE TRIGGER jobs_epoch_never_decreases BEFORE UPDATE OF epoch ON {s}.jobs
         FOR EACH ROW WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION {s}.epoch_never_decreases()",
        ])],
    },
    PgMigration {
        version: 8,
        name: "claims as HOT updates",
        // Issue #18, the fence's WAL and CPU per job. PostgreSQL writes an index entry in every
        // index of the table for each updated row unless no indexed column changed (a HOT
        // update; the columns of an index's WHERE count as indexed). `state` decided which
        // partial index a row was in (`jobs_due`, `jobs_leased`, `jobs_finished`), so every
        // claim and every commit wrote a primary-key entry plus one in the index the row moved
        // into: four entries per job against the plain loop's two.
        //
        // Now one index holds every job not yet finished, keyed by `run_at`, whatever its state:
        // a claim (pending -> running, a new epoch, owner and lease) changes no indexed column,
        // so it is HOT and writes no index entry; expired leases are found by the same scan (a
        // running row whose lease has run out). A heartbeat is not HOT: it writes `updated_at`,
        // a key of `jobs_finished`. `finished` is `state` for a
        // completed or dead row and NULL otherwise: it changes only when a job finishes (or is
        // requeued), and it is what `jobs_finished` is keyed by. The cost: a claim reads past the
        // queue's running rows (about 1 µs each; they are the oldest `run_at`s), from the claim
        // cursor on since then (`postgres/cursor.rs`), see docs/performance.md.
        //
        // The CHECK keeps `finished` equal to what `state` says, so a statement that finishes a
        // job without setting it fails instead of leaving the row in `jobs_open` (where every
        // claim would read past it) and out of the pruner's reach.
        //
        // Pages are now filled to 40 % (migration 6 chose 70): a HOT update needs room for the
        // new version on the row's own page, and one claim statement takes up to 64 consecutive
        // jobs, often every row of a page at once, whose old versions cannot be pruned before
        // the claim commits. At 70 % about 20 of a page's 45 rows fitted: a drain with claims of
        // 64 had 1,977 HOT claims of 4,000 (645-659 bytes of WAL per job); at 40 %, 4,000 of
        // 4,000 (503 bytes), in a plain-SQL replica of the drain
        // (`bench/sql/hot_claims_replica.sql`). The cost is disk: a backlog of pending jobs takes
        // 1/0.4 = 2.5 times the pages a packed table takes (1.4 at 70 %). It applies to pages
        // filled from then on.
        //
        // Locks (issue #30: this migration used to be one transaction that held ACCESS EXCLUSIVE
        // through the whole backfill, the validation and two index builds): the column and the
        // CHECK (NOT VALID: rows written from then on are checked, the ones there are not read)
        // are catalog changes, a transaction of milliseconds; the backfill sets `finished` on the
        // finished rows a schema holds in batches of `BACKFILL_BATCH` in primary-key order, a
        // transaction each, locking only the rows it changes (open rows, the ones claims,
        // heartbeats and commits touch, are not among them); the validation reads the table
        // under SHARE UPDATE EXCLUSIVE (writes go on); the indexes are built and the former ones
        // dropped CONCURRENTLY. The CHECK comes before the backfill so that a row finished while
        // the backfill runs (behind it, by a statement of this build) already has `finished`.
        steps: MIGRATION_8,
    },
    PgMigration {
        version: 9,
        name: "the epoch guard runs after the row is written",
        // Issue #18, the fence's WAL and CPU per update. A BEFORE UPDATE row trigger makes
        // PostgreSQL lock the row's old version before every update of the table (to hand the
        // trigger the version it will replace), and that lock is a WAL record of its own, even
        // when the trigger's column list or WHEN rules it out and the claim had locked the row
        // already (`FOR UPDATE SKIP LOCKED`): one more lock record per claim and per commit, 54
        // bytes each (`tests/runtime/throughput_cost.rs`: 523.5 -> 469.5 bytes per job). An AFTER
        // UPDATE row trigger gets both versions from the update itself. Its WHEN (`NEW.epoch <
        // OLD.epoch`) is checked as each row is updated; a row
        // that lowers an epoch queues the call, which raises at the end of the statement, so the
        // statement fails and nothing it wrote commits: the same guard (a plain-SQL replica of
        // the drain, claims of 64: 559 -> 503 bytes per job, the same as with no trigger).
        // Dropping and creating the trigger in one transaction: no update runs in between
        // without it.
        steps: &[Step::Tx(&[
            "DROP TRIGGER IF EXISTS jobs_epoch_never_decreases ON {s}.jobs",
            "CREATE TRIGGER jobs_epoch_never_decreases AFTER UPDATE OF epoch ON {s}.jobs
         FOR EACH ROW WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION {s}.epoch_never_decreases()",
        ])],
    },
    PgMigration {
        version: 10,
        name: "ledger owners",
        // Who sent the newest epoch of each ledger entry, so that an equal epoch from another
        // owner is refused (a fencing token handed out twice, see `crate::ledger`). A nullable
        // column without a default: a catalog change under a lock held for milliseconds, no
        // rewrite. Entries written before it have no owner and accept an equal epoch from
        // anyone, as they did.
        //
        // The epochs themselves need nothing: a claim starts a job's epoch at the timeline base
        // (`crate::epoch`), which is 0 on a server never promoted, so existing rows and the
        // epochs receivers keep stay valid as they are.
        steps: &[Step::Tx(&["ALTER TABLE {s}.ledger ADD COLUMN IF NOT EXISTS owner text"])],
    },
    PgMigration {
        version: 11,
        name: "job keys as JobKey checks them",
        // Issue #30 item 7. A job row whose key `JobKey::new` refuses (written by SQL around the
        // fence, or before the rules tightened) cannot be handed to a handler; the claim makes
        // such a row dead with the reason (`crate::key::unusable_key`), and from this migration
        // on the schema refuses to write one. The CHECK spares finished rows, so that this
        // migration makes the bad rows a schema holds dead (with the reason in `last_error`)
        // instead of deleting them, and the claim can do the same to a row the rules refuse
        // later. Online: the bad open rows are made dead (a read of the table, locking only
        // them), the CHECK is added NOT VALID (a catalog change), the rows made bad meanwhile
        // are made dead, and the CHECK is validated apart (SHARE UPDATE EXCLUSIVE: writes go on).
        // The rules: not empty and at most `MAX_KEY_BYTES` (1,024) bytes; `text` cannot hold the
        // NUL byte the third rule is about, and holds only valid UTF-8.
        steps: &[
            Step::Tx(&[DEAD_BAD_KEYS]),
            Step::Tx(&["DO $$ BEGIN
               IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = '{s}.jobs'::regclass
                   AND conname = 'jobs_key_is_valid') THEN
                 ALTER TABLE {s}.jobs ADD CONSTRAINT jobs_key_is_valid CHECK
                   (state IN ('completed', 'dead') OR (key <> '' AND octet_length(key) <= 1024)) NOT VALID;
               END IF;
             END $$"]),
            Step::Tx(&[DEAD_BAD_KEYS]),
            Step::Tx(&["ALTER TABLE {s}.jobs VALIDATE CONSTRAINT jobs_key_is_valid"]),
        ],
    },
    PgMigration {
        version: 12,
        name: "producer trace context",
        // Issue #34: the W3C `traceparent` / `tracestate` of the producer, written by `enqueue`
        // (feature `otel`) and handed back by `claim_next`, so an attempt continues the
        // producer's trace. Nullable columns without a default: a catalog change under a lock
        // held for milliseconds, no rewrite; existing rows have no context.
        steps: &[Step::Tx(&[
            "ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS traceparent text, ADD COLUMN IF NOT EXISTS tracestate text",
        ])],
    },
    PgMigration {
        version: 13,
        name: "dashboard activity and fence events",
        // Issue #35, the dashboard. Two new tables, a sequence and their indexes: nothing existing is
        // locked beyond the schema's catalog, and no statement on the jobs table changes (a claim
        // stays a HOT update). `activity` holds claims, commits, fenced rejections and lease losses
        // per queue and minute, added to by each worker's supervisor at most every
        // `SupervisorConfig::activity_interval`; `fence_events` is a ring of
        // `admin::FENCE_EVENT_SLOTS` rows (slot = seq mod slots, an upsert overwrites the oldest)
        // of who lost a job to whom. Both are pruned by age (`Retention::dashboard_age`).
        steps: &[Step::Tx(&[
            "CREATE TABLE IF NOT EXISTS {s}.activity (
            queue   text        COLLATE \"C\" NOT NULL,
            minute  timestamptz NOT NULL,
            claims  bigint      NOT NULL DEFAULT 0,
            commits bigint      NOT NULL DEFAULT 0,
            fenced  bigint      NOT NULL DEFAULT 0,
            lost    bigint      NOT NULL DEFAULT 0,
            PRIMARY KEY (queue, minute)
        )",
            "CREATE INDEX IF NOT EXISTS activity_minute ON {s}.activity (minute)",
            "CREATE SEQUENCE IF NOT EXISTS {s}.fence_event_seq",
            "CREATE TABLE IF NOT EXISTS {s}.fence_events (
            slot         bigint      PRIMARY KEY,
            seq          bigint      NOT NULL,
            at           timestamptz NOT NULL,
            queue        text        COLLATE \"C\" NOT NULL,
            key          text        COLLATE \"C\" NOT NULL,
            kind         text        NOT NULL CHECK (kind IN ('fenced', 'lease_lost')),
            detail       text        NOT NULL,
            epoch        bigint      NOT NULL,
            owner        text        NOT NULL,
            winner_epoch bigint,
            winner_owner text,
            winner_state text
        )",
            "CREATE INDEX IF NOT EXISTS fence_events_seq ON {s}.fence_events (seq)",
            "CREATE INDEX IF NOT EXISTS fence_events_queue ON {s}.fence_events (queue, seq)",
            "CREATE INDEX IF NOT EXISTS fence_events_at ON {s}.fence_events (at)",
        ])],
    },
    PgMigration {
        version: 14,
        name: "outbox trace context",
        // Issue #34: the W3C `traceparent` / `tracestate` of the attempt that wrote an outbox row
        // (feature `otel`), published with the message so its consumer continues that attempt's
        // trace rather than the relay's. Nullable columns without a default, like migration 12:
        // a catalog change, no rewrite; rows written before have no context.
        steps: &[Step::Tx(&[
            "ALTER TABLE {s}.outbox ADD COLUMN IF NOT EXISTS traceparent text, ADD COLUMN IF NOT EXISTS tracestate text",
        ])],
    },
];

/// The migration version this build needs: the newest embedded migration.
pub(super) const REQUIRED_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

mod apply;
