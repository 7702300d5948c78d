//! The batched claim's rounds (`claim_batch`): one statement per round, until every key has
//! an answer.

use crate::error::{FenceError, Result};
use crate::key::{JobKey, Owner, QueueName};
use crate::lease::Claim;
use crate::store::{claim_outcome, distinct_keys};

/// key, outcome/state, epoch, owner, lease_until ms, ttl ms, attempts, ms until run_at
pub(super) type ClaimRow = (String, String, i64, Option<String>, Option<i64>, Option<i64>, i64, Option<i64>);

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
