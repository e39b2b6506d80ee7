//! A mutex's data whether or not a thread panicked while holding it: every value the agent
//! guards stays consistent between statements (a panic leaves no half-made change worth
//! refusing the rest of the process over), and a poisoned lock must not take the agent down.
use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data of a poisoned lock as it is.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
