//! flashtier's text layer (in progress).
