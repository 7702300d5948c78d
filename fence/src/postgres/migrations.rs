//! The embedded PostgreSQL migrations and the online, lock-bounded way `migrate` applies them.

use std::time::Duration;

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection};

use super::PgFence;
use super::connect::pg_ms;
use super::prune::is_lock_timeout;
use crate::error::{FenceError, Result};
use crate::schema::{Migration, render};

pub(super) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "jobs and ledger",
        // The column order is WAL (issue #18). PostgreSQL logs a row version updated on its own
        // page from the first byte that changed to the last, so the columns a claim changes
        // (lease_until, state, epoch, attempts, owner) sit together, right after the ones a
        // commit changes (updated_at, result, lease_until, state), and the ones neither touches
        // come first. In the order of the columns' meaning (state, epoch, owner, lease_until,
        // attempts, run_at, payload, ..., updated_at) a claim and a commit each logged most of
        // the row: 743-762 bytes of WAL per job against 689-702 in this order
        // (`tests/throughput_cost.rs`; `failures`, added by migration 3, comes last either way).
        // No statement depends on the order: every one names its columns, so a schema created in
        // the former order works the same and keeps it (a rewrite of the table is not worth its
        // lock). `finished` (migration 8) sits with the columns a commit changes; a schema created
        // before it has the column at the end.
        statements: &[
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
    Migration {
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
        statements: &[
            "DROP TRIGGER IF EXISTS jobs_epoch_never_decreases ON {s}.jobs",
            "CREATE TRIGGER jobs_epoch_never_decreases BEFORE UPDATE OF epoch ON {s}.jobs
         FOR EACH ROW WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION {s}.epoch_never_decreases()",
        ],
    },
    Migration {
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
        // Locks: the column is a catalog change; the UPDATE rewrites the finished rows a schema
        // already holds (none in a fresh one); the CHECK is added NOT VALID and validated (a
        // read of the table); the indexes are built under a SHARE lock on the table (writes wait
        // while they are built). All in the migration's transaction, under its lock timeout.
        statements: &[
            "ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS finished text",
            "UPDATE {s}.jobs SET finished = state \
             WHERE state IN ('completed', 'dead') AND finished IS DISTINCT FROM state",
            "ALTER TABLE {s}.jobs DROP CONSTRAINT IF EXISTS jobs_finished_is_final_state",
            "ALTER TABLE {s}.jobs ADD CONSTRAINT jobs_finished_is_final_state CHECK \
             (finished IS NOT DISTINCT FROM (CASE WHEN state IN ('completed', 'dead') THEN state END)) NOT VALID",
            "ALTER TABLE {s}.jobs VALIDATE CONSTRAINT jobs_finished_is_final_state",
            "CREATE INDEX IF NOT EXISTS jobs_open ON {s}.jobs (queue, run_at) WHERE finished IS NULL",
            "DROP INDEX IF EXISTS {s}.jobs_finished",
            "CREATE INDEX jobs_finished ON {s}.jobs (queue, finished, updated_at) WHERE finished IS NOT NULL",
            "DROP INDEX IF EXISTS {s}.jobs_due",
            "DROP INDEX IF EXISTS {s}.jobs_leased",
            "ALTER TABLE {s}.jobs SET (fillfactor = 40)",
        ],
    },
    Migration {
        version: 9,
        name: "the epoch guard runs after the row is written",
        // Issue #18, the fence's WAL and CPU per update. A BEFORE UPDATE row trigger makes
        // PostgreSQL lock the row's old version before every update of the table (to hand the
        // trigger the version it will replace), and that lock is a WAL record of its own, even
        // when the trigger's column list or WHEN rules it out and the claim had locked the row
        // already (`FOR UPDATE SKIP LOCKED`): one more lock record per claim and per commit, 54
        // bytes each (`tests/throughput_cost.rs`: 523.5 -> 469.5 bytes per job). An AFTER
        // UPDATE row trigger gets both versions from the update itself. Its WHEN (`NEW.epoch <
        // OLD.epoch`) is checked as each row is updated; a row
        // that lowers an epoch queues the call, which raises at the end of the statement, so the
        // statement fails and nothing it wrote commits: the same guard (a plain-SQL replica of
        // the drain, claims of 64: 559 -> 503 bytes per job, the same as with no trigger).
        // Dropping and creating the trigger in one transaction: no update runs in between
        // without it.
        statements: &[
            "DROP TRIGGER IF EXISTS jobs_epoch_never_decreases ON {s}.jobs",
            "CREATE TRIGGER jobs_epoch_never_decreases AFTER UPDATE OF epoch ON {s}.jobs
         FOR EACH ROW WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION {s}.epoch_never_decreases()",
        ],
    },
    Migration {
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
        statements: &["ALTER TABLE {s}.ledger ADD COLUMN IF NOT EXISTS owner text"],
    },
];

/// The migration version this build needs: the newest embedded migration.
pub(super) const REQUIRED_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

impl PgFence {
    /// One migration (or, with `None`, only the schema and its record) with retries: a lock
    /// timeout rolls the step back, waits (200 ms doubling to 5 s, with jitter) and tries again
    /// until `give_up_after` has passed.
    pub(super) async fn migration_step(&self, conn: &mut PgConnection, m: Option<&Migration>) -> Result<()> {
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
    pub(super) async fn migration_try(&self, conn: &mut PgConnection, m: Option<&Migration>) -> Result<()> {
        let s = self.schema.as_str();
        let mut tx = conn.begin().await?;
        // One migrator per schema at a time, across processes; released at commit. Waiting for
        // the other migrator blocks no traffic, so that wait has no lock timeout. The NOTICEs of
        // the idempotent statements ("already exists, skipping", "does not exist, skipping") are
        // not sent: a worker that migrates at start-up would log one per statement, every start.
        sqlx::query(
            "SELECT set_config('lock_timeout', '0', true), set_config('statement_timeout', '0', true), \
             set_config('client_min_messages', 'warning', true)",
        )
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('brokerfence.migrate.' || $1, 0))")
            .persistent(false)
            .bind(s.to_owned())
            .execute(&mut *tx)
            .await?;
        // Every lock on a fence table from here on: wait briefly, or let go and retry.
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .persistent(false)
            .bind(pg_ms(self.migration.lock_timeout).to_string())
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS {s}")))
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {s}._migrations (version bigint PRIMARY KEY, name text NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )))
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        if let Some(m) = m {
            let applied: Option<i64> =
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {s}._migrations WHERE version = $1")))
                    .persistent(false)
                    .bind(m.version)
                    .fetch_optional(&mut *tx)
                    .await?;
            if applied.is_none() {
                for stmt in m.statements {
                    sqlx::query(AssertSqlSafe(render(stmt, &self.schema)))
                        .persistent(false)
                        .execute(&mut *tx)
                        .await
                        .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source })?;
                }
                sqlx::query(AssertSqlSafe(format!("INSERT INTO {s}._migrations (version, name) VALUES ($1, $2)")))
                    .persistent(false)
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
}
