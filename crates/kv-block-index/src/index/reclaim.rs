//! Retired memory: what the writer unlinked, held until no reader can
//! still see it, then freed; and the index's teardown.
//!
//! The writer replaces chain states, hash buffers, the head table and the
//! chain directory by pointer stores; readers may still be walking the old
//! ones. Each unlinked pointer goes to a [`Garbage`] list under the writer
//! lock. Once the list is worth it (a batch of replaced states and buffers,
//! or any table or directory, which are large), the writer takes it out of
//! the lock, waits for a grace period (module `rcu`) and frees it, so other
//! writers go on meanwhile and readers never wait. This module holds every
//! `Box::from_raw` of the shared structures, with the reason each is sound.

use crate::chain::{ChainState, HashBuf};
use crate::sync::Ordering;
use crate::table::Table;

use super::{Dir, Inner, Writer};

/// Replaced states and buffers gathered before a writer waits for a grace
/// period. Under loom every event that replaced something frees it, so the
/// models race readers against reclamation.
#[cfg(not(loom))]
const GARBAGE_BATCH: usize = 64;
#[cfg(loom)]
const GARBAGE_BATCH: usize = 1;

/// Unlinked memory waiting for a grace period.
pub(super) struct Garbage(Vec<GarbageItem>);

/// One unlinked allocation, by kind (each is freed as its own box).
pub(super) enum GarbageItem {
    Table(*mut Table),
    Dir(*mut Dir),
    State(*mut ChainState),
    Buf(*mut HashBuf),
}

// SAFETY: the pointers are uniquely owned by the garbage list once unlinked
// (readers only borrow them until the grace period ends); freeing them from
// another thread is fine, as for a Box.
unsafe impl Send for Garbage {}

impl Garbage {
    /// An empty list.
    pub(super) fn new() -> Self {
        Self(Vec::new())
    }

    /// Hands over an allocation the writer has just unlinked: no table,
    /// directory or published state leads to it any more.
    pub(super) fn push(&mut self, item: GarbageItem) {
        self.0.push(item);
    }

    /// Frees everything. Call only after a grace period that began after
    /// the items were unlinked.
    pub(super) fn free(&mut self) {
        for item in self.0.drain(..) {
            // Each pointer came from Box::into_raw, was unlinked (no table,
            // directory or published state leads to it any more), and no
            // reader can still hold it.
            match item {
                // SAFETY: see above.
                GarbageItem::Table(t) => drop(unsafe { Box::from_raw(t) }),
                // SAFETY: see above.
                GarbageItem::Dir(d) => drop(unsafe { Box::from_raw(d) }),
                // SAFETY: see above (a state does not own its buffer).
                GarbageItem::State(s) => drop(unsafe { Box::from_raw(s) }),
                // SAFETY: see above.
                GarbageItem::Buf(b) => drop(unsafe { Box::from_raw(b) }),
            }
        }
    }
}

impl Inner {
    /// Takes the garbage out when it is worth a grace period.
    pub(super) fn take_garbage(w: &mut Writer) -> Option<Garbage> {
        if w.urgent || w.garbage.0.len() >= GARBAGE_BATCH {
            w.urgent = false;
            Some(std::mem::replace(&mut w.garbage, Garbage::new()))
        } else {
            None
        }
    }

    /// Waits for a grace period and frees the garbage (outside the writer
    /// lock, so other writers go on).
    pub(super) fn reclaim(&self, garbage: Option<Garbage>) {
        if let Some(mut garbage) = garbage {
            self.rcu.synchronize();
            garbage.free();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.writer.lock().garbage.free();
        // Dropping the index: no reader or writer is left; the directory,
        // the head table and every current state and its buffer are owned
        // by the index alone.
        // SAFETY: see above.
        let dir = unsafe { Box::from_raw(self.dir.load(Ordering::Acquire)) };
        for slot in dir.slots.iter() {
            let ptr = slot.load(Ordering::Acquire);
            if !ptr.is_null() {
                // SAFETY: see above.
                let state = unsafe { Box::from_raw(ptr) };
                // SAFETY: see above; no other state names this buffer.
                drop(unsafe { Box::from_raw(state.buf.cast_mut()) });
            }
        }
        // SAFETY: see above.
        drop(unsafe { Box::from_raw(self.heads.load(Ordering::Acquire)) });
    }
}
