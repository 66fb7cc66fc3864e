//! The completion side of the [`Reaper`]: drain the completion queue,
//! resubmit short and interrupted reads, free finished slots (the kernel is
//! done with their memory), and complete the tickets. A slot is freed only
//! on its own completion, which is what the buffer-lifetime contract of
//! `ring.rs` rests on.

use super::{InFlight, NOP_TAG, Reaper, WAKE_TAG};
use crate::backend::{Landed, Landing};
use crate::error::IoError;
use crate::uring::Waker;

impl Reaper {
    /// Drain the completion queue and act on every completion.
    pub(crate) fn reap(&mut self, waker: Option<&Waker>) {
        self.cqes.clear();
        self.cqes
            .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for i in 0..self.cqes.len() {
            let Some(&(tag, res)) = self.cqes.get(i) else {
                break;
            };
            match tag {
                WAKE_TAG => {
                    self.wake_armed = false;
                    if let (false, Some(waker)) = (self.closing, waker) {
                        self.arm_wake(waker);
                    }
                }
                NOP_TAG => {}
                _ => self.complete_slot(tag as usize, res),
            }
        }
    }

    fn complete_slot(&mut self, slot: usize, res: i32) {
        let Some(f) = self.slots.table.get_mut(slot).and_then(Option::as_mut) else {
            tracing::error!(slot, "io_uring completion for an empty slot");
            return;
        };
        if res < 0 {
            if matches!(-res, libc::EINTR | libc::EAGAIN) {
                return self.submit_slot(slot);
            }
            return self.fail_read(slot, std::io::Error::from_raw_os_error(-res));
        }
        if res == 0 {
            return self.fail_eof(slot);
        }
        f.got += res as usize;
        if f.got >= f.req.len {
            return self.finish(slot, Ok(()));
        }
        // A short read: resubmit the remainder. Direct I/O only stops short
        // of an aligned boundary at end of file.
        let next = f.req.offset + f.got as u64;
        if f.req.file.is_direct() && next % f.req.file.offset_align() as u64 != 0 {
            return self.fail_eof(slot);
        }
        self.submit_slot(slot);
    }

    fn fail_eof(&mut self, slot: usize) {
        if let Some(f) = self.slots.table.get(slot).and_then(Option::as_ref) {
            let err = IoError::ShortRead {
                path: f.req.file.path().to_path_buf(),
                offset: f.req.offset,
                len: f.req.len,
                got: f.got,
            };
            self.finish(slot, Err(err));
        }
    }

    pub(super) fn fail_read(&mut self, slot: usize, source: std::io::Error) {
        if let Some(f) = self.slots.table.get(slot).and_then(Option::as_ref) {
            let err = IoError::Read {
                path: f.req.file.path().to_path_buf(),
                offset: f.req.offset,
                len: f.req.len,
                source,
            };
            self.finish(slot, Err(err));
        }
    }

    /// Free the slot (the kernel is done with it) and queue its outcome for
    /// [`Reaper::deliver`].
    pub(super) fn finish(&mut self, slot: usize, outcome: Result<(), IoError>) {
        let Some(f) = self.slots.table.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.slots.free.push(slot);
        self.landed.push((f, outcome));
    }

    /// Complete the tickets of finished reads. Runs after freed slots have
    /// been refilled and submitted, so the device is busy meanwhile.
    pub(crate) fn deliver(&mut self) {
        let mut landed = std::mem::take(&mut self.landed);
        for (f, outcome) in landed.drain(..) {
            Self::complete(f, outcome);
        }
        self.landed = landed;
    }

    fn complete(f: InFlight, outcome: Result<(), IoError>) {
        let InFlight {
            req,
            idx,
            done,
            staged,
            ..
        } = f;
        if let (Err(_), Landing::Device { sink, .. }, Some((_, off))) =
            (&outcome, &req.landing, &staged)
        {
            // The read failed: its staging slot will never be committed.
            sink.abort(*off, req.len);
        }
        let result = outcome.and_then(|()| {
            if let (Landing::Device { sink, dst }, Some((_, off))) = (&req.landing, &staged) {
                sink.commit(*off, req.len, *dst)
                    .map_err(|what| IoError::Device {
                        path: req.file.path().to_path_buf(),
                        offset: req.offset,
                        len: req.len,
                        what,
                    })?;
            }
            let buf = match req.landing {
                Landing::Host(mut b) => {
                    b.set_len(req.len);
                    Some(b)
                }
                _ => None,
            };
            Ok(Landed {
                tag: req.tag,
                len: req.len,
                buf,
            })
        });
        done.complete(idx, result);
    }
}
