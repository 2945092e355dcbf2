//! Errors of the tree core: every input-dependent failure is a value, never a panic.

use std::fmt;

/// What went wrong. The Python bindings map `BadArgument` to `ValueError` and the others to
/// `RuntimeError`; on `BadArgument` the structure is unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A bad argument: wrong size, unknown node id, value out of range, double free...
    BadArgument(String),
    /// `unlock` of a node (or the root) that holds no lock.
    NotLocked(String),
    /// `free_group_begin` / `free_group_end` called out of order.
    FreeGroup(String),
    /// A broken internal invariant, found by `sanity_check`.
    Invariant(String),
}

pub type CoreResult<T> = Result<T, CoreError>;

impl CoreError {
    pub fn message(&self) -> &str {
        match self {
            Self::BadArgument(m) | Self::NotLocked(m) | Self::FreeGroup(m) | Self::Invariant(m) => {
                m
            }
        }
    }
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for CoreError {}

pub(crate) fn bad<T>(msg: String) -> CoreResult<T> {
    Err(CoreError::BadArgument(msg))
}

pub(crate) fn broken<T>(msg: String) -> CoreResult<T> {
    Err(CoreError::Invariant(msg))
}
