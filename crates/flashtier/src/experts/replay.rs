//! Replay (filled in below).
