//! The Lua scripts. Each takes its keys in `KEYS` and its values in `ARGV` only — no script text is
//! ever built from data — and each is loaded once and run with `EVALSHA`, falling back to `EVAL`
//! (and loading it again) when the server answers `NOSCRIPT`, e.g. after a restart or `SCRIPT FLUSH`.

use std::sync::LazyLock;

use ::redis::Script;

/// Acquire (or refresh) lease keys.
/// KEYS: lease keys. ARGV[1]: ttl in ms; ARGV[1+i]: token i; ARGV[1+n+i]: epoch i.
/// Per key: 1 = set with `SET NX PX` (or it already held this token: `PEXPIRE`), 2 = took it over
/// from an older epoch, 0 = refused (held by the same or a newer epoch of another token).
const ACQUIRE: &str = r"
local ms = ARGV[1]
local n = #KEYS
local out = {}
for i = 1, n do
  local token = ARGV[1 + i]
  local epoch = tonumber(ARGV[1 + n + i])
  if redis.call('SET', KEYS[i], token, 'NX', 'PX', ms) then
    out[i] = 1
  else
    local cur = redis.call('GET', KEYS[i])
    if cur == token then
      redis.call('PEXPIRE', KEYS[i], ms)
      out[i] = 1
    else
      local held = nil
      if cur then held = tonumber(string.match(cur, ':(%-?%d+)$')) end
      if held ~= nil and epoch ~= nil and held < epoch then
        redis.call('SET', KEYS[i], token, 'PX', ms)
        out[i] = 2
      else
        out[i] = 0
      end
    end
  end
end
return out
";

/// Renew lease keys: `GET == token → PEXPIRE`.
/// KEYS: lease keys. ARGV[1]: ttl in ms; ARGV[1+i]: token i.
/// Per key: 1 = renewed, 0 = missing, -1 = held by another token (untouched).
const RENEW: &str = r"
local out = {}
for i = 1, #KEYS do
  local cur = redis.call('GET', KEYS[i])
  if cur == ARGV[1 + i] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  elseif cur then
    out[i] = -1
  else
    out[i] = 0
  end
end
return out
";

/// Release lease keys: `GET == token → DEL`.
/// KEYS: lease keys. ARGV[i]: token i. Per key: 1 = deleted, 0 = not ours (untouched).
const RELEASE: &str = r"
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then
    redis.call('DEL', KEYS[i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
";

/// Dead-letter one stream entry: `XACK` it and, only if that acknowledged it (it was still pending:
/// an entry is moved once, however many deliveries of it are dead-lettered), copy it to the
/// dead-letter stream with the reason; release its lease key if it is ours.
/// KEYS[1]: stream; KEYS[2]: dead-letter stream; KEYS[3] (optional): lease key.
/// ARGV[1]: group; ARGV[2]: entry id; ARGV[3]: reason; ARGV[4]: lease token (with KEYS[3]).
/// Returns the number of entries acknowledged (0 or 1).
const STREAM_DEAD: &str = r"
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if KEYS[3] and redis.call('GET', KEYS[3]) == ARGV[4] then redis.call('DEL', KEYS[3]) end
if acked == 0 then return 0 end
local args = {KEYS[2], '*', 'dead.reason', ARGV[3], 'dead.stream', KEYS[1], 'dead.group', ARGV[1], 'dead.id', ARGV[2]}
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if e[1] and e[1][2] then
  local f = e[1][2]
  if #f <= 7000 then
    for j = 1, #f do args[#args + 1] = f[j] end
  else
    args[#args + 1] = 'dead.note'
    args[#args + 1] = 'too many fields to copy'
  end
else
  args[#args + 1] = 'dead.note'
  args[#args + 1] = 'entry no longer in the stream'
end
redis.call('XADD', unpack(args))
return acked
";

/// The heartbeat of stream entries whose leases the database just confirmed: per entry, take or
/// renew its lease key, then `XCLAIM … JUSTID` it to this consumer (idle back to 0) — but only
/// for a lease that is still the newest Redis knows of, so that a stale renewal (a worker that
/// froze between the database's answer and this call, while another consumer took the entry
/// over) never takes the entry back.
/// KEYS[1]: stream; KEYS[1+i]: lease key of entry i (n = #KEYS - 1).
/// ARGV[1]: group; ARGV[2]: consumer; ARGV[3]: ttl in ms; ARGV[3+i]: entry id i;
/// ARGV[3+n+i]: token i (`<owner>:<epoch>`); ARGV[3+2n+i]: epoch i.
/// Per entry:
///  1 = the key held this token: renewed, entry claimed (from whichever consumer had it: a rival
///      that found the job busy only held it back);
///  2 = the key was missing or held an older epoch: taken, and the entry claimed if this consumer
///      still has it;
///  3 = as 2, but another consumer has the entry now (it took it over): the key is taken, the
///      entry is left alone (a live holder claims it on its next heartbeat, when the key is its
///      own; a stale one is found lost by the database first);
///  0 = the key holds the same or a newer epoch of another token: nothing touched;
/// -1 = the key is ours but the entry is no longer pending (acknowledged, or the group is gone).
const STREAM_EXTEND: &str = r"
local n = #KEYS - 1
local out = {}
for i = 1, n do
  local key, id, token = KEYS[1 + i], ARGV[3 + i], ARGV[3 + n + i]
  local epoch = tonumber(ARGV[3 + 2 * n + i])
  local cur = redis.call('GET', key)
  local held = cur == token
  local take = held or not cur
  if not take then
    local other = tonumber(string.match(cur, ':(%-?%d+)$'))
    take = other ~= nil and epoch ~= nil and other < epoch
  end
  if not take then
    out[i] = 0
  else
    redis.call('SET', key, token, 'PX', ARGV[3])
    local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], id, id, 1)
    if type(p) ~= 'table' or p.err or #p == 0 then
      out[i] = -1
    elseif held or p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
      if held then out[i] = 1 else out[i] = 2 end
    else
      out[i] = 3
    end
  end
end
return out
";

/// Move up to ARGV[1] items from the queue (right end) to the processing list (left end).
/// KEYS[1]: queue; KEYS[2]: processing. Returns the items moved.
const LIST_TAKE: &str = r"
local out = {}
for i = 1, tonumber(ARGV[1]) do
  local item = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
  if not item then break end
  out[#out + 1] = item
end
return out
";

/// Acknowledge list items: remove one copy of each from the processing list and release its lease
/// key if it is ours. KEYS[1]: processing; KEYS[1+i]: lease key i. ARGV[i]: item i; ARGV[n+i]:
/// token i. Returns the number of items removed.
const LIST_ACK: &str = r"
local n = #KEYS - 1
local removed = 0
for i = 1, n do
  removed = removed + redis.call('LREM', KEYS[1], 1, ARGV[i])
  if redis.call('GET', KEYS[1 + i]) == ARGV[n + i] then redis.call('DEL', KEYS[1 + i]) end
end
return removed
";

/// Give a list item back: remove one copy from the processing list, push it on the consuming end
/// of the queue (it is next), release the lease key if it is ours.
/// KEYS[1]: processing; KEYS[2]: queue; KEYS[3]: lease key; KEYS[4]: the list's reap count (a
/// put-back, as the reaper's: see `LIST_REAP`). ARGV[1]: item; ARGV[2]: token.
/// Returns 1 when the item was moved back.
const LIST_REQUEUE: &str = r"
local moved = 0
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('INCR', KEYS[4])
  moved = 1
end
if redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('DEL', KEYS[3]) end
return moved
";

/// Dead-letter a list item: remove one copy from the processing list and, only if that removed
/// it (the item is moved once, however many deliveries of it are dead-lettered: a second call for
/// an item already moved, or reaped back to the queue, adds nothing), add it to the dead-letter
/// stream with the reason; release the lease key if it is ours.
/// KEYS[1]: processing; KEYS[2]: dead-letter stream; KEYS[3]: lease key (may be the empty string's
/// key when none). ARGV[1]: item; ARGV[2]: token; ARGV[3]: reason; ARGV[4]: queue list name.
/// Returns 1 when the item was in the processing list (and was dead-lettered).
const LIST_DEAD: &str = r"
local removed = redis.call('LREM', KEYS[1], 1, ARGV[1])
if removed == 1 then
  redis.call('XADD', KEYS[2], '*', 'dead.reason', ARGV[3], 'dead.list', ARGV[4], 'item', ARGV[1])
end
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('DEL', KEYS[3]) end
return removed
";

/// Dead-letter a popped item (the list retrofit) once per marker: a send whose answer was lost
/// (a timeout) is sent again, and the marker makes the second send add nothing.
/// KEYS[1]: dead-letter stream; KEYS[2]: the marker of this dead letter (same slot).
/// ARGV[1]: reason; ARGV[2]: list name; ARGV[3]: item; ARGV[4]: marker lifetime in ms.
/// Returns 1 when the entry was added, 0 when this dead letter was sent before.
const LIST_DEAD_ONCE: &str = r"
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[4]) then return 0 end
redis.call('XADD', KEYS[1], '*', 'dead.reason', ARGV[1], 'dead.list', ARGV[2], 'item', ARGV[3])
return 1
";

/// One pass of the reaper. KEYS[1]: processing; KEYS[2]: queue; KEYS[3]: the list's reap count
/// (bumped whenever an item is put back, by any reaper or by an abandon); KEYS[3+i]: lease key of item i. ARGV[i]: item i;
/// ARGV[n+i]: '1' when item i was already seen without a lease key on the previous pass;
/// ARGV[2n+1]: the reap count at that pass. Per item: 0 = has a lease key, 1 = no lease key (a
/// suspect), 2 = put back on the queue; then the reap count now. A suspect goes back only when no
/// reaper put anything back since the previous pass: a value seen keyless then may be another
/// copy now (put back by another reaper and taken again, its lease key not yet reserved).
const LIST_REAP: &str = r"
local n = #KEYS - 3
local count = tonumber(redis.call('GET', KEYS[3]) or '0')
local quiet = tostring(count) == ARGV[2 * n + 1]
local out = {}
local back = 0
for i = 1, n do
  if redis.call('EXISTS', KEYS[3 + i]) == 1 then
    out[i] = 0
  elseif quiet and ARGV[n + i] == '1' and redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    out[i] = 2
    back = back + 1
  else
    out[i] = 1
  end
end
if back > 0 then count = redis.call('INCR', KEYS[3]) end
out[n + 1] = count
return out
";

/// The scripts, hashed once per process.
pub(crate) struct Scripts {
    pub acquire: Script,
    pub renew: Script,
    pub release: Script,
    pub stream_dead: Script,
    pub stream_extend: Script,
    pub list_take: Script,
    pub list_ack: Script,
    pub list_requeue: Script,
    pub list_dead: Script,
    pub list_dead_once: Script,
    pub list_reap: Script,
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    acquire: Script::new(ACQUIRE),
    renew: Script::new(RENEW),
    release: Script::new(RELEASE),
    stream_dead: Script::new(STREAM_DEAD),
    stream_extend: Script::new(STREAM_EXTEND),
    list_take: Script::new(LIST_TAKE),
    list_ack: Script::new(LIST_ACK),
    list_requeue: Script::new(LIST_REQUEUE),
    list_dead: Script::new(LIST_DEAD),
    list_dead_once: Script::new(LIST_DEAD_ONCE),
    list_reap: Script::new(LIST_REAP),
});
