//! Low-bit companions (filled in below).
