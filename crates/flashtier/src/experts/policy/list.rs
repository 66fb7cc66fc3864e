//! Intrusive doubly linked lists over record indices, the O(1) building block
//! of every eviction policy.
//!
//! One [`Links`] table holds the `prev`/`next` links of every record; a record
//! sits in at most one list at a time (named by a small list id), so several
//! queues (S3-FIFO's small, main and ghost queues) share one table. Memory:
//! 10 bytes per record of the store, allocated once.

/// No record.
pub(crate) const NIL: u32 = u32::MAX;

/// Head, tail and length of one list. `head` is the most recently inserted end.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ends {
    id: u16,
    head: u32,
    tail: u32,
    len: usize,
}

impl Ends {
    /// An empty list with id `id` (non-zero; zero means "in no list").
    pub(crate) const fn new(id: u16) -> Self {
        Self {
            id,
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Number of records in the list.
    pub(crate) const fn len(&self) -> usize {
        self.len
    }

    /// The oldest record (`None` when empty).
    pub(crate) const fn tail(&self) -> Option<u32> {
        if self.tail == NIL {
            None
        } else {
            Some(self.tail)
        }
    }
}

/// The link table.
#[derive(Debug, Clone)]
pub(crate) struct Links {
    prev: Vec<u32>,
    next: Vec<u32>,
    list: Vec<u16>,
}

impl Links {
    /// Links for records `0..n`, none in a list.
    pub(crate) fn new(n: usize) -> Self {
        Self {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            list: vec![0; n],
        }
    }

    /// The list id record `i` is in (0 = none).
    pub(crate) fn list_of(&self, i: u32) -> u16 {
        self.list.get(i as usize).copied().unwrap_or(0)
    }

    /// The record inserted just before `i` (towards the head), or `NIL`.
    pub(crate) fn newer(&self, i: u32) -> u32 {
        self.prev.get(i as usize).copied().unwrap_or(NIL)
    }

    /// Insert `i` (in no list) at the head of `l`.
    pub(crate) fn push_front(&mut self, l: &mut Ends, i: u32) {
        debug_assert_eq!(self.list_of(i), 0, "record {i} already in a list");
        let u = i as usize;
        self.prev[u] = NIL;
        self.next[u] = l.head;
        if l.head == NIL {
            l.tail = i;
        } else {
            self.prev[l.head as usize] = i;
        }
        l.head = i;
        l.len += 1;
        self.list[u] = l.id;
    }

    /// Remove `i` from `l` (it must be in `l`).
    pub(crate) fn remove(&mut self, l: &mut Ends, i: u32) {
        debug_assert_eq!(self.list_of(i), l.id, "record {i} not in list {}", l.id);
        let u = i as usize;
        let (p, n) = (self.prev[u], self.next[u]);
        if p == NIL {
            l.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            l.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[u] = NIL;
        self.next[u] = NIL;
        self.list[u] = 0;
        l.len -= 1;
    }

    /// Remove and return the oldest record of `l`.
    pub(crate) fn pop_back(&mut self, l: &mut Ends) -> Option<u32> {
        let t = l.tail()?;
        self.remove(l, t);
        Some(t)
    }

    /// Move `i` (in `l`) to the head of `l`.
    pub(crate) fn move_to_front(&mut self, l: &mut Ends, i: u32) {
        self.remove(l, i);
        self.push_front(l, i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_remove_pop_keep_order() {
        let mut links = Links::new(8);
        let mut l = Ends::new(1);
        for i in 0..5 {
            links.push_front(&mut l, i);
        }
        links.remove(&mut l, 2);
        links.move_to_front(&mut l, 0);
        let mut order = Vec::new();
        while let Some(t) = links.pop_back(&mut l) {
            order.push(t);
        }
        assert_eq!(order, vec![1, 3, 4, 0]);
        assert_eq!(l.len(), 0);
        assert_eq!(links.list_of(3), 0);
    }
}
