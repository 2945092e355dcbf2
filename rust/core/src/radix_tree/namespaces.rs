//! Interned extra_key namespaces: a string becomes a small id while root children use it.
//!
//! Id 0 is "no namespace" (None or ""). A namespace is interned when its first root child is
//! created and forgotten when its last one is evicted, so cache salts do not pile up.

use std::collections::HashMap;

#[derive(Default)]
pub(crate) struct Namespaces {
    ids: HashMap<String, u32>,
    /// Per id: the name and how many root children use it (slot 0 unused).
    entries: Vec<(String, u32)>,
    free_ids: Vec<u32>,
}

impl Namespaces {
    pub fn new() -> Self {
        Self {
            entries: vec![(String::new(), 0)],
            ..Self::default()
        }
    }

    /// Some(id) of a known namespace (0 for none); None when no node uses it.
    pub fn lookup(&self, extra_key: Option<&str>) -> Option<u32> {
        match extra_key {
            None | Some("") => Some(0),
            Some(name) => self.ids.get(name).copied(),
        }
    }

    /// The id of `extra_key`, interning it when new (refcount starts at 0).
    pub fn intern(&mut self, extra_key: Option<&str>) -> u32 {
        if let Some(id) = self.lookup(extra_key) {
            return id;
        }
        let name = extra_key.unwrap_or_default().to_owned();
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.entries[id as usize] = (name.clone(), 0);
                id
            }
            None => {
                self.entries.push((name.clone(), 0));
                (self.entries.len() - 1) as u32
            }
        };
        self.ids.insert(name, id);
        id
    }

    /// A root child in namespace `id` was created.
    pub fn retain(&mut self, id: u32) {
        if id != 0 {
            self.entries[id as usize].1 += 1;
        }
    }

    /// A root child in namespace `id` was evicted.
    pub fn release(&mut self, id: u32) {
        if id == 0 {
            return;
        }
        let entry = &mut self.entries[id as usize];
        entry.1 -= 1;
        if entry.1 == 0 {
            let name = std::mem::take(&mut entry.0);
            self.ids.remove(&name);
            self.free_ids.push(id);
        }
    }

    /// Root children counted per namespace id (index 0 unused).
    pub fn refcounts(&self) -> Vec<u32> {
        self.entries.iter().map(|e| e.1).collect()
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn memory_bytes(&self) -> usize {
        let names: usize = self.entries.iter().map(|e| 2 * e.0.capacity()).sum();
        names
            + self.entries.capacity() * std::mem::size_of::<(String, u32)>()
            + self.ids.capacity() * 40
    }
}
