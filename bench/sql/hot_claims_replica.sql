-- A plain-SQL replica of the table queue's drain (issue #18, PostgreSQL migrations 8 and 9): the
-- jobs table with the fence's columns and indexes, claims of :n jobs in run_at order with
-- FOR UPDATE SKIP LOCKED, commits of :n once :k jobs are running. It measures what the fillfactor
-- and the epoch trigger cost in WAL and HOT updates, without the fence's runtime. Figures of
-- docs/performance.md ("Claims are HOT updates", "The epoch guard runs after the row").
--
--   psql -X -q -v ff=40 -v n=64 -v k=384 -v trigger=none -f bench/sql/hot_claims_replica.sql
--
-- ff: fillfactor of the jobs table (the fence: 40; migration 6 had 70). trigger: none, before or
-- after (the epoch guard as a BEFORE or AFTER UPDATE OF epoch row trigger with its WHEN). Prints WAL
-- bytes per job (pg_current_wal_lsn(), so run it on an otherwise idle server) and the HOT share of
-- the updates. Leaves nothing behind (its schema is dropped).
\set ON_ERROR_STOP on
DROP SCHEMA IF EXISTS hot_replica CASCADE;
CREATE SCHEMA hot_replica;
CREATE TABLE hot_replica.jobs (
    queue text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL,
    run_at timestamptz NOT NULL DEFAULT clock_timestamp(), created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    payload bytea, progress bytea, last_error text, updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    result bytea, finished text, lease_until timestamptz, state text NOT NULL DEFAULT 'pending',
    epoch bigint NOT NULL DEFAULT 0, attempts bigint NOT NULL DEFAULT 0, owner text,
    failures bigint NOT NULL DEFAULT 0, PRIMARY KEY (queue, key));
ALTER TABLE hot_replica.jobs SET (fillfactor = :ff);
CREATE INDEX jobs_open ON hot_replica.jobs (queue, run_at) WHERE finished IS NULL;
CREATE INDEX jobs_finished ON hot_replica.jobs (queue, finished, updated_at) WHERE finished IS NOT NULL;
CREATE FUNCTION hot_replica.epoch_never_decreases() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'epoch would go from % to %', OLD.epoch, NEW.epoch; END $$;
SELECT :'trigger' = 'before' AS before_trigger, :'trigger' = 'after' AS after_trigger \gset
\if :before_trigger
CREATE TRIGGER guard BEFORE UPDATE OF epoch ON hot_replica.jobs FOR EACH ROW
  WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION hot_replica.epoch_never_decreases();
\elif :after_trigger
CREATE TRIGGER guard AFTER UPDATE OF epoch ON hot_replica.jobs FOR EACH ROW
  WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION hot_replica.epoch_never_decreases();
\endif
-- The drain: claim n, and once k are running commit the n oldest claims, until nothing is left.
CREATE PROCEDURE hot_replica.drain(n int, k int) LANGUAGE plpgsql AS $$
DECLARE keys text[]; BEGIN
  LOOP
    WITH pick AS (SELECT queue, key FROM hot_replica.jobs WHERE queue = 'q' AND finished IS NULL
        AND run_at <= (SELECT clock_timestamp())
        AND (state IN ('pending', 'failed') OR lease_until < (SELECT clock_timestamp()))
        ORDER BY run_at LIMIT n FOR UPDATE SKIP LOCKED)
    UPDATE hot_replica.jobs t SET state = 'running', epoch = t.epoch + 1, owner = 'worker-0123456789abcdef',
        lease_until = clock_timestamp() + interval '30 s', attempts = t.attempts + 1
      FROM pick WHERE t.queue = pick.queue AND t.key = pick.key;
    COMMIT;
    SELECT array_agg(key) INTO keys FROM (SELECT key FROM hot_replica.jobs WHERE queue = 'q'
        AND finished IS NULL AND state = 'running' ORDER BY lease_until LIMIT n) x;
    EXIT WHEN keys IS NULL;
    IF (SELECT count(*) FROM hot_replica.jobs WHERE queue = 'q' AND finished IS NULL AND state = 'running') >= k
       OR NOT EXISTS (SELECT 1 FROM hot_replica.jobs WHERE queue = 'q' AND finished IS NULL AND state = 'pending') THEN
      UPDATE hot_replica.jobs t SET state = 'completed', finished = 'completed', result = 'ok', lease_until = NULL,
          updated_at = clock_timestamp() WHERE t.queue = 'q' AND t.key = ANY (keys) AND t.state = 'running';
      COMMIT;
    END IF;
  END LOOP;
END $$;
INSERT INTO hot_replica.jobs (queue, key, payload)
  SELECT 'q', 'job-' || lpad(i::text, 7, '0'), '{"n":1}'::bytea FROM generate_series(1, 4000) i;
SELECT pg_current_wal_lsn() AS wal_before \gset
CALL hot_replica.drain(:n, :k);
SELECT pg_current_wal_lsn() AS wal_after \gset
SELECT pg_stat_force_next_flush();
SELECT :ff AS fillfactor, :'trigger' AS epoch_trigger, :n AS per_claim, :k AS in_flight,
       round(pg_wal_lsn_diff(:'wal_after', :'wal_before') / 4000.0, 1) AS wal_bytes_per_job,
       n_tup_upd AS updates, n_tup_hot_upd AS hot_updates
  FROM pg_stat_user_tables WHERE relid = 'hot_replica.jobs'::regclass;
DROP SCHEMA hot_replica CASCADE;
