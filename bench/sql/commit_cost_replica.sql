-- A plain-SQL replica of the table queue's commit (issue #33): the jobs table with the fence's
-- columns, CHECKs, indexes and epoch trigger (as of PostgreSQL migration 12; the jobs table has
-- not changed since), drained in claims of
-- :n jobs, each followed by a commit of the same jobs (in random order, as they finish). It times
-- only the commit statements, in one session, and prints microseconds per committed job, so that
-- what a commit costs PostgreSQL can be taken apart: the statement's shape, the index the pruner
-- reads, the CHECKs. Figures of docs/performance.md (section "Shared names, fewer allocations,
-- and where the rest of the gap is (issue #33)").
--
--   psql -X -q -At -v n=43 -v variant=fence -v drop=none -f bench/sql/commit_cost_replica.sql
--
-- variant: fence (the statement `complete_batch` sends: five arrays unnested with their ordinals,
-- sorted by key, compared per row, the committed ordinals returned) or plain (the bench's plain loop's `UPDATE … WHERE key = ANY`,
-- no compare-and-set). drop: none, finished_index (`jobs_finished`), checks (the four CHECKs),
-- trigger (the epoch guard). The session settings are the fence's (index scans only, generic
-- plans); the transactions' COMMITs are not timed (`synchronous_commit` is off to keep the run
-- short). 8,000 jobs per run;
-- run the variants in turn (A/B/A/B), the figures move by about ±1 µs between runs. Leaves
-- nothing behind (its schema is dropped).
\set ON_ERROR_STOP on
SET client_min_messages = warning;
SET enable_seqscan = off; SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off;
SET plan_cache_mode = force_generic_plan; SET synchronous_commit = off;
DROP SCHEMA IF EXISTS commit_replica CASCADE;
CREATE SCHEMA commit_replica;
CREATE TABLE commit_replica.jobs (
    queue text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL,
    run_at timestamptz NOT NULL DEFAULT clock_timestamp(), created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    payload bytea, progress bytea, last_error text, updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    result bytea, finished text, lease_until timestamptz, state text NOT NULL DEFAULT 'pending',
    epoch bigint NOT NULL DEFAULT 0, attempts bigint NOT NULL DEFAULT 0, owner text,
    failures bigint NOT NULL DEFAULT 0, traceparent text, tracestate text,
    CONSTRAINT jobs_epoch_check CHECK (epoch >= 0),
    CONSTRAINT jobs_finished_is_final_state CHECK (NOT (finished IS DISTINCT FROM
        CASE WHEN state IN ('completed', 'dead') THEN state ELSE NULL END)),
    CONSTRAINT jobs_key_is_valid CHECK (state IN ('completed', 'dead') OR (key <> '' AND octet_length(key) <= 1024)),
    CONSTRAINT jobs_state_check CHECK (state IN ('pending', 'running', 'completed', 'failed', 'dead')),
    PRIMARY KEY (queue, key)) WITH (fillfactor = 40);
CREATE INDEX jobs_open ON commit_replica.jobs (queue, run_at) WHERE finished IS NULL;
CREATE INDEX jobs_finished ON commit_replica.jobs (queue, finished, updated_at) WHERE finished IS NOT NULL;
CREATE FUNCTION commit_replica.epoch_never_decreases() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'epoch would go from % to %', OLD.epoch, NEW.epoch; END $$;
CREATE TRIGGER jobs_epoch_never_decreases AFTER UPDATE OF epoch ON commit_replica.jobs FOR EACH ROW
  WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION commit_replica.epoch_never_decreases();
SELECT :'drop' = 'finished_index' AS drop_index, :'drop' = 'checks' AS drop_checks, :'drop' = 'trigger' AS drop_trigger,
       :'variant' = 'fence' AS fence_statement \gset
\if :drop_index
DROP INDEX commit_replica.jobs_finished;
\endif
\if :drop_checks
ALTER TABLE commit_replica.jobs DROP CONSTRAINT jobs_epoch_check, DROP CONSTRAINT jobs_finished_is_final_state,
  DROP CONSTRAINT jobs_key_is_valid, DROP CONSTRAINT jobs_state_check;
\endif
\if :drop_trigger
DROP TRIGGER jobs_epoch_never_decreases ON commit_replica.jobs;
\endif
-- The drain: claim n (as `claim_next` does), then commit them; only the commits are timed.
CREATE PROCEDURE commit_replica.drain(n int, fence bool, INOUT spent float8) LANGUAGE plpgsql AS $$
DECLARE ks text[]; qs text[]; os text[]; es bigint[]; rs bytea[]; t0 timestamptz; got bigint;
BEGIN
  spent := 0;
  LOOP
    WITH pick AS (SELECT queue, key FROM commit_replica.jobs WHERE queue = 'q' AND finished IS NULL
        AND run_at <= (SELECT clock_timestamp())
        AND (state IN ('pending', 'failed') OR lease_until < (SELECT clock_timestamp()))
        ORDER BY run_at LIMIT n FOR UPDATE SKIP LOCKED)
    UPDATE commit_replica.jobs t SET state = 'running', epoch = t.epoch + 1, owner = 'worker-0123456789abcdef',
        lease_until = clock_timestamp() + interval '30 s', attempts = t.attempts + 1
      FROM pick WHERE t.queue = pick.queue AND t.key = pick.key;
    COMMIT;
    SELECT array_agg(key), array_agg(queue), array_agg(owner), array_agg(epoch), array_agg('ok'::bytea)
      INTO ks, qs, os, es, rs FROM (SELECT key, queue, owner, epoch FROM commit_replica.jobs WHERE queue = 'q'
        AND finished IS NULL AND state = 'running' ORDER BY random() LIMIT n) x;
    EXIT WHEN ks IS NULL;
    t0 := clock_timestamp();
    IF fence THEN
      WITH u AS (SELECT *, 'running'::text AS running
          FROM unnest(qs, ks, os, es, rs) WITH ORDINALITY AS u(queue, key, owner, epoch, result, i)),
      done AS (UPDATE commit_replica.jobs t SET state = 'completed', finished = 'completed', result = u.result,
          lease_until = NULL, updated_at = clock_timestamp() FROM (SELECT * FROM u ORDER BY queue, key) u
          WHERE t.queue = u.queue AND t.key = u.key AND t.owner = u.owner AND t.epoch = u.epoch
            AND t.state = u.running RETURNING u.i)
      SELECT count(*) INTO got FROM done;
    ELSE
      UPDATE commit_replica.jobs SET state = 'completed', finished = 'completed', result = 'ok', lease_until = NULL,
          updated_at = clock_timestamp() WHERE queue = 'q' AND key = ANY (ks) AND state = 'running';
    END IF;
    spent := spent + extract(epoch FROM clock_timestamp() - t0);
    COMMIT;
  END LOOP;
END $$;
INSERT INTO commit_replica.jobs (queue, key, payload)
  SELECT 'q', 'job-' || lpad(i::text, 7, '0'), '{"n":1}'::bytea FROM generate_series(1, 8000) i;
CALL commit_replica.drain(:n, :'fence_statement', NULL) \gset committed_
SELECT :'variant' AS statement, :'drop' AS dropped, :n AS per_commit,
       round((:committed_spent * 1e6 / 8000)::numeric, 2) AS commit_us_per_job;
DROP SCHEMA commit_replica CASCADE;
