//! The transitions: the store statements each step applies ([`ProtocolModel::store_step`]), what
//! a worker does with the answers, and the stateright [`Model`] (initial states, enabled actions,
//! next states, properties).

use stateright::{Model, Property};

use crate::db::{self, Answer, JobState, Row};
use crate::state::{Action, Broker, Disposition, HeldLease, Phase, Receiver, State, Worker};
use crate::{ProtocolModel, Source, W};

impl ProtocolModel {
    /// The database's answer to a store step in `s`, and the row after it (None when `a` is no
    /// store step or is not enabled). Shared by the transition and the replay against the real store.
    ///
    /// ```
    /// use brokerfence_model::{Action, Answer, ProtocolModel, Source};
    /// use stateright::Model;
    /// let model = ProtocolModel::new(Source::Table, 2);
    /// let init = &model.init_states()[0];
    /// let (_, answer) = model.store_step(init, Action::ClaimNext(0)).unwrap();
    /// assert_eq!(answer, Answer::Claimed { epoch: 1 });
    /// ```
    pub fn store_step(&self, s: &State, a: Action) -> Option<(Option<Row>, Answer)> {
        let g = &self.guards;
        let b = &self.bounds;
        match a {
            Action::ClaimNext(w) => {
                let wk = s.workers.get(usize::from(w))?;
                (self.source == Source::Table && wk.phase == Phase::Idle && !wk.paused)
                    .then(|| db::claim_next(s.row, w, b, g))
            }
            Action::ClaimBatch(w) => {
                let wk = s.workers.get(usize::from(w))?;
                (wk.phase == Phase::Received && !wk.paused).then(|| db::claim_batch(s.row, w, b, g))
            }
            Action::Heartbeat(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && matches!(wk.phase, Phase::Running | Phase::Returned(_) | Phase::EarlyAck))
                    .then(|| db::heartbeat(s.row, w, l.epoch, b, g))
            }
            Action::Complete(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && wk.phase == Phase::Returned(true)).then(|| db::complete(s.row, w, l.epoch, g))
            }
            Action::Fail(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && wk.phase == Phase::Returned(false)).then(|| db::fail(s.row, w, l.epoch, b, g))
            }
            Action::Release(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && wk.phase == Phase::Running && !l.sent && s.releases_left > 0)
                    .then(|| db::release(s.row, w, l.epoch, g))
            }
            _ => None,
        }
    }

    /// Whether the handler of `w` may take a step now (the supervisor's `Guarded` poll check).
    fn handler_may_run(&self, wk: &Worker) -> bool {
        match wk.lease {
            Some(l) if wk.phase == Phase::Running && !wk.paused => {
                !self.guards.cancel_on_loss || (!l.lost && l.deadline > 0)
            }
            _ => false,
        }
    }

    /// A handler step: notes whether it runs past its lease on the database clock.
    fn handler_step(s: &mut State, w: usize) {
        if let Some(l) = s.workers[w].lease
            && l.granted < 0
        {
            s.ran_past_lease = true;
        }
    }

    /// Whether the message or entry of the job has been deleted or acknowledged at the broker.
    pub fn broker_done(&self, s: &State) -> bool {
        match s.broker {
            Broker::None => false,
            Broker::Sqs { present, .. } => !present,
            Broker::Stream { delivered, pending, .. } => delivered && pending.is_none(),
        }
    }

    /// Every job completed or dead.
    pub fn all_done(&self, s: &State) -> bool {
        matches!(s.row, Some(r) if matches!(r.state, JobState::Completed | JobState::Dead))
    }

    fn settle(&self, s: &mut State, w: W, d: Disposition) {
        let wi = usize::from(w);
        let lease = s.workers[wi].lease;
        let stale_ok = self.bounds.stale_handles;
        match &mut s.broker {
            Broker::None => {}
            Broker::Sqs { present, hidden, newest } => {
                // Every call with a receipt handle: accepted with the newest one, and (LocalStack)
                // with a stale one too.
                let accepted = *present && (stale_ok || *newest == Some(w));
                if accepted {
                    match d {
                        // DeleteMessage; dead-letter = SendMessage to the DLQ, then DeleteMessage.
                        Disposition::Ack | Disposition::DeadLetter => *present = false,
                        Disposition::RetryLater(t) | Disposition::Hold(t) => *hidden = t.max(0),
                        Disposition::Abandon => *hidden = 0,
                        Disposition::Leave => {}
                    }
                }
            }
            Broker::Stream { pending, reclaim_in, lease_key, .. } => {
                let ours = |k: &Option<(W, u8, i8)>| matches!((k, lease), (Some((o, e, _)), Some(l)) if *o == w && *e == l.epoch);
                match d {
                    // XACK (it does not check the consumer); the lease key released by compare-and-set.
                    // STREAM_DEAD: XACK, and the copy to the dead stream only if that acknowledged it.
                    Disposition::Ack | Disposition::DeadLetter => {
                        *pending = None;
                        if ours(lease_key) {
                            *lease_key = None;
                        }
                    }
                    // reclaim_after: XCLAIM … IDLE so that XAUTOCLAIM takes it after the delay;
                    // retry_later and abandon also release the lease key if ours.
                    Disposition::RetryLater(_) | Disposition::Hold(_) | Disposition::Abandon => {
                        if pending.is_some() {
                            *pending = Some(w);
                            *reclaim_in = match d {
                                Disposition::RetryLater(t) | Disposition::Hold(t) => t.max(0),
                                _ => 0,
                            };
                        }
                        if !matches!(d, Disposition::Hold(_)) && ours(lease_key) {
                            *lease_key = None;
                        }
                    }
                    Disposition::Leave => {
                        // The `lost` hook: release_lost, by compare-and-set.
                        if ours(lease_key) {
                            *lease_key = None;
                        }
                    }
                }
            }
        }
    }

    fn after_claim(&self, s: &mut State, w: W, answer: Answer) {
        let wi = usize::from(w);
        let lease = self.bounds.lease;
        match answer {
            Answer::Claimed { epoch } => {
                s.claims += 1;
                s.workers[wi].phase = Phase::Running;
                s.workers[wi].lease = Some(HeldLease {
                    epoch,
                    serial: s.claims,
                    deadline: lease,
                    granted: lease,
                    lost: false,
                    sent: false,
                    hint_due: false,
                });
                if let Some(r) = s.row.as_mut() {
                    r.serial = s.claims;
                }
            }
            other => {
                let d = match other {
                    Answer::Busy { ttl } => Disposition::Hold(ttl),
                    Answer::Done => Disposition::Ack,
                    Answer::Dead => Disposition::DeadLetter,
                    Answer::Backoff { retry_in } => Disposition::RetryLater(retry_in),
                    _ => Disposition::Leave,
                };
                s.workers[wi].phase = if self.source == Source::Table { Phase::Idle } else { Phase::Settle(d) };
            }
        }
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let b = &self.bounds;
        let (row, broker) = match self.source {
            // enqueue: the row exists, pending, at the queue's epoch floor (0).
            Source::Table => (Some(Row::pending()), Broker::None),
            // The producer sent the message; the row is inserted by the first claim.
            Source::Sqs => (None, Broker::Sqs { present: true, hidden: 0, newest: None }),
            Source::RedisStream => {
                (None, Broker::Stream { delivered: false, pending: None, reclaim_in: 0, lease_key: None })
            }
        };
        vec![State {
            row,
            workers: vec![Worker { phase: Phase::Idle, paused: false, lease: None }; usize::from(b.workers)],
            broker,
            receiver: Receiver::default(),
            pauses_left: b.pauses,
            errors_left: b.errors,
            releases_left: b.releases,
            claims: 0,
            commits: 0,
            foreign_commit: false,
            ran_past_lease: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        out.push(Action::Tick);
        for (i, wk) in s.workers.iter().enumerate() {
            let w = i as W;
            if wk.paused {
                out.push(Action::Resume(w));
                continue;
            }
            if s.pauses_left > 0 {
                out.push(Action::Pause(w));
            }
            match wk.phase {
                Phase::Idle => match (self.source, s.broker) {
                    (Source::Table, _) => out.push(Action::ClaimNext(w)),
                    (Source::Sqs, Broker::Sqs { present: true, hidden: 0, .. }) => out.push(Action::SqsReceive(w)),
                    (Source::RedisStream, Broker::Stream { delivered, pending, reclaim_in, .. }) => {
                        if !delivered {
                            out.push(Action::XReadGroup(w));
                        } else if pending.is_some() && reclaim_in == 0 {
                            out.push(Action::XAutoClaim(w));
                        }
                    }
                    _ => {}
                },
                Phase::Received => out.push(Action::ClaimBatch(w)),
                Phase::Running => {
                    out.push(Action::Heartbeat(w));
                    let l = wk.lease;
                    if l.is_some_and(|l| l.hint_due) {
                        out.push(Action::Extend(w));
                    }
                    if self.handler_may_run(wk) {
                        if self.bounds.effects && l.is_some_and(|l| !l.sent) {
                            out.push(Action::HandlerSend(w));
                        }
                        out.push(Action::HandlerOk(w));
                        if s.errors_left > 0 {
                            out.push(Action::HandlerErr(w));
                        }
                    } else if self.guards.cancel_on_loss {
                        out.push(Action::Cancel(w));
                    }
                    if s.releases_left > 0 && l.is_some_and(|l| !l.sent) {
                        out.push(Action::Release(w));
                    }
                }
                Phase::EarlyAck => {
                    out.push(Action::Heartbeat(w));
                    out.push(Action::Settle(w));
                }
                Phase::Returned(ok) => {
                    out.push(Action::Heartbeat(w));
                    if wk.lease.is_some_and(|l| l.hint_due) {
                        out.push(Action::Extend(w));
                    }
                    out.push(if ok { Action::Complete(w) } else { Action::Fail(w) });
                }
                Phase::Settle(_) => out.push(Action::Settle(w)),
            }
        }
        for i in 0..s.receiver.in_flight.len() {
            out.push(Action::Accept(i as u8));
        }
    }

    fn next_state(&self, last: &State, a: Action) -> Option<State> {
        let mut s = last.clone();
        let lease_len = self.bounds.lease;
        match a {
            Action::Tick => {
                if let Some(r) = s.row.as_mut() {
                    r.tick();
                }
                for wk in &mut s.workers {
                    if let Some(l) = wk.lease.as_mut() {
                        l.deadline = (l.deadline - 1).max(-1);
                        l.granted = (l.granted - 1).max(-1);
                    }
                }
                match &mut s.broker {
                    Broker::None => {}
                    Broker::Sqs { hidden, .. } => *hidden = (*hidden - 1).max(0),
                    Broker::Stream { reclaim_in, lease_key, .. } => {
                        *reclaim_in = (*reclaim_in - 1).max(0);
                        if let Some((_, _, ttl)) = lease_key.as_mut() {
                            *ttl -= 1;
                        }
                        if matches!(lease_key, Some((_, _, t)) if *t <= 0) {
                            *lease_key = None;
                        }
                    }
                }
            }
            Action::Pause(w) => {
                s.workers[usize::from(w)].paused = true;
                s.pauses_left -= 1;
            }
            Action::Resume(w) => s.workers[usize::from(w)].paused = false,
            Action::SqsReceive(w) => {
                if let Broker::Sqs { hidden, newest, .. } = &mut s.broker {
                    *hidden = lease_len;
                    *newest = Some(w);
                }
                s.workers[usize::from(w)].phase = Phase::Received;
            }
            Action::XReadGroup(w) | Action::XAutoClaim(w) => {
                if let Broker::Stream { delivered, pending, reclaim_in, .. } = &mut s.broker {
                    *delivered = true;
                    *pending = Some(w);
                    *reclaim_in = lease_len;
                }
                s.workers[usize::from(w)].phase = Phase::Received;
            }
            Action::ClaimNext(w) | Action::ClaimBatch(w) => {
                let (row, answer) = self.store_step(last, a)?;
                if answer == Answer::Nothing {
                    return None;
                }
                s.row = row;
                self.after_claim(&mut s, w, answer);
            }
            Action::Heartbeat(w) => {
                let (row, answer) = self.store_step(last, a)?;
                s.row = row;
                let wi = usize::from(w);
                match answer {
                    Answer::Renewed => {
                        if let Some(l) = s.workers[wi].lease.as_mut() {
                            l.deadline = lease_len;
                            l.hint_due = self.source != Source::Table;
                        }
                    }
                    _ => {
                        if let Some(l) = s.workers[wi].lease.as_mut() {
                            l.lost = true;
                        }
                    }
                }
                // The lease end the database now holds belongs to the row's current epoch.
                if let Some(r) = s.row
                    && r.state == JobState::Running
                {
                    for (i, wk) in s.workers.iter_mut().enumerate() {
                        if let Some(l) = wk.lease.as_mut()
                            && r.owner == Some(i as W)
                            && r.epoch == l.epoch
                            && l.serial == r.serial
                        {
                            l.granted = l.granted.max(r.lease_left);
                        }
                    }
                }
            }
            Action::Extend(w) => {
                let wi = usize::from(w);
                let l = s.workers[wi].lease?;
                s.workers[wi].lease = Some(HeldLease { hint_due: false, ..l });
                let stale_ok = self.bounds.stale_handles;
                match &mut s.broker {
                    Broker::Sqs { present, hidden, newest } => {
                        // ChangeMessageVisibility to the time left on the database lease.
                        if *present && (stale_ok || *newest == Some(w)) {
                            *hidden = l.deadline.max(0);
                        }
                    }
                    Broker::Stream { pending, reclaim_in, lease_key, .. } => {
                        // STREAM_EXTEND.
                        let held = matches!(lease_key, Some((o, e, _)) if *o == w && *e == l.epoch);
                        let take = held || lease_key.is_none() || matches!(lease_key, Some((_, e, _)) if *e < l.epoch);
                        if take {
                            *lease_key = Some((w, l.epoch, lease_len));
                            if pending.is_some() && (held || *pending == Some(w)) {
                                *pending = Some(w);
                                *reclaim_in = lease_len;
                            }
                        }
                    }
                    Broker::None => {}
                }
            }
            Action::Cancel(w) => {
                let wi = usize::from(w);
                s.workers[wi].phase = Phase::Settle(Disposition::Leave);
            }
            Action::HandlerSend(w) => {
                let wi = usize::from(w);
                Self::handler_step(&mut s, wi);
                let l = s.workers[wi].lease.as_mut()?;
                l.sent = true;
                let m = (l.epoch, l.serial);
                if let Err(i) = s.receiver.in_flight.binary_search(&m) {
                    s.receiver.in_flight.insert(i, m);
                }
            }
            Action::HandlerOk(w) => {
                let wi = usize::from(w);
                Self::handler_step(&mut s, wi);
                s.workers[wi].phase = if self.guards.ack_after_commit || self.source == Source::Table {
                    Phase::Returned(true)
                } else {
                    Phase::EarlyAck
                };
            }
            Action::HandlerErr(w) => {
                let wi = usize::from(w);
                Self::handler_step(&mut s, wi);
                s.errors_left -= 1;
                s.workers[wi].phase = Phase::Returned(false);
            }
            Action::Complete(w) | Action::Fail(w) | Action::Release(w) => {
                let (row, answer) = self.store_step(last, a)?;
                let wi = usize::from(w);
                let l = s.workers[wi].lease?;
                if matches!(a, Action::Complete(_)) && answer == Answer::Ok {
                    s.commits += 1;
                    let current = last.row.is_some_and(|r| r.epoch == l.epoch && r.serial == l.serial);
                    if !current {
                        s.foreign_commit = true;
                    }
                }
                if matches!(a, Action::Release(_)) {
                    s.releases_left -= 1;
                }
                s.row = row;
                let d = match answer {
                    Answer::Ok if matches!(a, Action::Complete(_)) => Disposition::Ack,
                    Answer::Ok => Disposition::Abandon,
                    Answer::Retry { retry_in } => Disposition::RetryLater(retry_in),
                    Answer::Dead => Disposition::DeadLetter,
                    _ => Disposition::Leave,
                };
                s.workers[wi].phase = if self.source == Source::Table { Phase::Idle } else { Phase::Settle(d) };
                if self.source == Source::Table {
                    s.workers[wi].lease = None;
                }
            }
            Action::Settle(w) => {
                let wi = usize::from(w);
                match last.workers[wi].phase {
                    Phase::EarlyAck => {
                        self.settle(&mut s, w, Disposition::Ack);
                        s.workers[wi].phase = Phase::Returned(true);
                        return Some(s);
                    }
                    Phase::Settle(d) => self.settle(&mut s, w, d),
                    _ => return None,
                }
                s.workers[wi].phase = Phase::Idle;
                s.workers[wi].lease = None;
            }
            Action::Accept(i) => {
                let (epoch, serial) = s.receiver.in_flight.remove(usize::from(i));
                let r = &mut s.receiver;
                // ledger.accept: INSERT … ON CONFLICT DO UPDATE SET epoch = EXCLUDED.epoch
                // WHERE l.epoch <= EXCLUDED.epoch — no row back: refused.
                let accepted = !self.guards.receiver_ledger || r.ledger.is_none_or(|e| e <= epoch);
                if accepted {
                    r.ledger = Some(epoch);
                    if r.max_epoch.is_some_and(|e| epoch < e) {
                        r.epoch_went_back = true;
                    }
                    if r.max_serial.is_some_and(|x| serial < x) {
                        r.attempt_went_back = true;
                    }
                    r.max_epoch = Some(r.max_epoch.map_or(epoch, |e| e.max(epoch)));
                    r.max_serial = Some(r.max_serial.map_or(serial, |x| x.max(serial)));
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at most one committed result, by the current attempt", |_: &ProtocolModel, s: &State| {
                s.commits <= 1 && !s.foreign_commit
            }),
            Property::always(
                "the receiver never accepts a lower epoch (or an older attempt)",
                |_: &ProtocolModel, s: &State| !s.receiver.epoch_went_back && !s.receiver.attempt_went_back,
            ),
            Property::always(
                "no broker delete or ack before the job is committed or dead",
                |m: &ProtocolModel, s: &State| !m.broker_done(s) || m.all_done(s),
            ),
            Property::always("no handler runs past its lease on the database clock", |_: &ProtocolModel, s: &State| {
                !s.ran_past_lease
            }),
        ]
    }
}
