//! Interned tenant ids.

use std::collections::HashMap;
use std::sync::Arc;

use crate::sync::{AtomicU32, Ordering, RwLock};

/// Interned tenant handle; cheap to copy and compare.
///
/// Ids are dense (`0, 1, 2, ...` in interning order) and are never reused
/// within one tree for a different name while the tree lives. An id is only
/// meaningful for the tree that interned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub(crate) u32);

impl TenantId {
    /// The dense index of this tenant (its interning order), usable to index
    /// per-tenant arrays.
    pub fn index(self) -> u32 {
        self.0
    }
}

/// Name <-> id table. Touched only by `intern`/`tenant_id`/`tenant_name`, never
/// by the lookup or insert paths (those see the `count` atomic only).
#[derive(Debug)]
pub(crate) struct Interner {
    table: RwLock<Table>,
    count: AtomicU32,
}

#[derive(Debug, Default)]
struct Table {
    by_name: HashMap<Arc<str>, u32>,
    names: Vec<Arc<str>>,
}

impl Interner {
    pub(crate) fn new() -> Self {
        Self {
            table: RwLock::new(Table::default()),
            count: AtomicU32::new(0),
        }
    }

    pub(crate) fn intern(&self, name: &str) -> TenantId {
        if let Some(&id) = self.table.read().by_name.get(name) {
            return TenantId(id);
        }
        let mut table = self.table.write();
        if let Some(&id) = table.by_name.get(name) {
            return TenantId(id);
        }
        // More than 2^32 distinct tenants cannot be represented; saturating
        // keeps the call panic-free (the last id is then shared).
        let id = u32::try_from(table.names.len()).unwrap_or(u32::MAX);
        let name: Arc<str> = Arc::from(name);
        table.names.push(Arc::clone(&name));
        table.by_name.insert(name, id);
        self.count
            .store(table.names.len() as u32, Ordering::Release);
        TenantId(id)
    }

    pub(crate) fn get(&self, name: &str) -> Option<TenantId> {
        self.table.read().by_name.get(name).map(|&id| TenantId(id))
    }

    pub(crate) fn name(&self, id: TenantId) -> Option<Arc<str>> {
        self.table.read().names.get(id.0 as usize).cloned()
    }

    /// Number of interned tenants; ids below it are valid.
    #[inline]
    pub(crate) fn count(&self) -> u32 {
        self.count.load(Ordering::Acquire)
    }

    #[inline]
    pub(crate) fn is_valid(&self, id: TenantId) -> bool {
        id.0 < self.count()
    }
}
