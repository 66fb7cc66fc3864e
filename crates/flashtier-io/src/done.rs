//! [`DoneQueue`]: where finished tickets drop their tokens, so a caller with
//! many tickets in flight wakes once for a batch of completions instead of
//! once per completion (see [`crate::Ticket::notify_on_done_to`]).
//!
//! Bound: it holds at most one token per ticket registered with it, so the
//! caller bounds it by bounding its outstanding tickets.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A queue of completion tokens with a batched wait. See the module docs.
#[derive(Debug, Default)]
pub struct DoneQueue {
    inner: Mutex<Inner>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct Inner {
    tokens: Vec<u64>,
    /// Tokens the sleeping waiter wants before it is woken (0: none sleeps).
    want: usize,
}

impl DoneQueue {
    /// An empty queue.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Add a token; wakes the waiter once it has what it asked for.
    pub fn push(&self, token: u64) {
        let mut g = self.lock();
        g.tokens.push(token);
        if g.want > 0 && g.tokens.len() >= g.want {
            g.want = 0;
            drop(g);
            self.cv.notify_one();
        }
    }

    /// Wait until at least `min` tokens are queued (at least one) or `timeout`
    /// has passed, then move every queued token into `out`. Returns how many
    /// were moved (possibly 0 on timeout). One waiter at a time.
    pub fn wait(&self, min: usize, timeout: Duration, out: &mut Vec<u64>) -> usize {
        let min = min.max(1);
        let deadline = Instant::now() + timeout;
        let mut g = self.lock();
        while g.tokens.len() < min {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            g.want = min;
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        g.want = 0;
        let n = g.tokens.len();
        out.append(&mut g.tokens);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn waits_for_a_batch_or_the_timeout() {
        let q = Arc::new(DoneQueue::new());
        let mut out = Vec::new();
        assert_eq!(q.wait(1, Duration::from_millis(1), &mut out), 0);
        let q2 = q.clone();
        let t = std::thread::spawn(move || (0..5).for_each(|i| q2.push(i)));
        let mut got = 0;
        while got < 5 {
            got += q.wait(5 - got, Duration::from_secs(5), &mut out);
        }
        let _ = t.join();
        assert_eq!(out, vec![0, 1, 2, 3, 4]);
    }
}
