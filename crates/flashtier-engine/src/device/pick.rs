//! The device-neutral handle of a greedy pick left on a device
//! ([`crate::device::Device::pick_ahead`]).

/// A greedy pick a device left where it ran ([`Device::pick_ahead`]):
/// which of the device's picks it is and the width of the row it was
/// picked from. Only the device that started it reads it; one it did not
/// start, or no longer keeps, is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PickTicket {
    seq: u64,
    cols: usize,
}

impl PickTicket {
    /// The ticket of a device's pick number `seq` over `cols` columns.
    #[must_use]
    pub fn new(seq: u64, cols: usize) -> Self {
        Self { seq, cols }
    }

    /// Picks the device started before this one.
    #[must_use]
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Width of the row picked from (the id is below it).
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }
}
