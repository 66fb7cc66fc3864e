//! flashtier serve (in progress).
