//! A persistent B+tree: ordered keys, values in the leaves, and a summary of every subtree kept
//! beside the child pointer in its parent.
//!
//! Persistence is copy-on-write through [`Arc::make_mut`]: cloning a tree is O(1) (one `Arc`
//! clone of the root), and a change copies only the nodes on the path from the root to the
//! changed leaf (O(log n) nodes of at most [`MAX_FANOUT`] entries) when they are shared with
//! another version; nodes that only this version owns are changed in place. Every other node
//! stays shared between the old and the new version.
//!
//! The summaries turn the tree into an augmented search tree: the host-address index stores the
//! largest range end of each subtree so that an overlap query can skip subtrees that end before
//! the queried range (an interval tree). Indexes that need no summary use `()`, which costs
//! nothing.
//!
//! This file holds the node types, lookups and iteration; `edit` holds the single-key
//! changes (insert and remove, with their splits and rebalancing) and `batch` the one-pass
//! write of a sorted batch.

use std::mem::size_of;
use std::sync::Arc;

use arrayvec::ArrayVec;

use crate::search::count_prefix;

mod batch;
mod edit;

/// Most entries (values in a leaf, children in an inner node) a node holds.
pub(crate) const MAX_FANOUT: usize = 32;
/// A node with fewer entries is merged with, or refilled from, a sibling when a removal passes
/// through it. Splits that append at the end of a full node leave the new right node with a
/// single entry (so that building a tree in key order fills nodes completely); such a node fills
/// up as later appends arrive, and a removal rebalances it like any other underfull node.
const MIN_FANOUT: usize = MAX_FANOUT / 2;

/// What a tree remembers about each subtree.
pub(crate) trait Summary<K, V>: Copy + Default {
    /// The summary of a single entry.
    fn of_entry(key: &K, value: &V) -> Self;
    /// The summary of two adjacent groups of entries. `Default::default()` is its identity.
    fn merge(self, other: Self) -> Self;
}

impl<K, V> Summary<K, V> for () {
    fn of_entry(_: &K, _: &V) -> Self {}
    fn merge(self, _: Self) -> Self {}
}

/// What a pruned search does with a subtree or an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Visit {
    /// Descend into the subtree, or report the entry.
    Enter,
    /// Pass over this subtree or entry and go on with the next one.
    Skip,
    /// End the search: nothing at or after this point in key order can match.
    Stop,
}

#[derive(Clone)]
struct Node<K, V, S> {
    /// In a leaf, the key of each value; in an inner node, the smallest key of each child.
    keys: ArrayVec<K, MAX_FANOUT>,
    items: Items<K, V, S>,
}

// Both kinds live inside the node's one allocation; boxing either would add a pointer chase.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Items<K, V, S> {
    Leaf(ArrayVec<V, MAX_FANOUT>),
    Inner {
        /// The summary of each child, kept here so that a search can prune a child without
        /// loading it.
        sums: ArrayVec<S, MAX_FANOUT>,
        children: ArrayVec<Arc<Node<K, V, S>>, MAX_FANOUT>,
    },
}

/// The index of the child of an inner node whose key range holds `key`: the last child whose
/// smallest key is at most `key`, or the first child if `key` is below every key.
fn child_index<K: Ord>(keys: &[K], key: &K) -> usize {
    keys.partition_point(|k| k <= key).saturating_sub(1)
}

impl<K: Ord + Copy, V: Clone, S: Summary<K, V>> Node<K, V, S> {
    fn leaf() -> Self {
        Node {
            keys: ArrayVec::new(),
            items: Items::Leaf(ArrayVec::new()),
        }
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn summary(&self) -> S {
        match &self.items {
            Items::Leaf(values) => self
                .keys
                .iter()
                .zip(values)
                .fold(S::default(), |acc, (k, v)| acc.merge(S::of_entry(k, v))),
            Items::Inner { sums, .. } => sums.iter().fold(S::default(), |acc, s| acc.merge(*s)),
        }
    }

    /// Calls `emit` on every entry a pruned in-order walk reaches; returns false once `prune`
    /// said [`Visit::Stop`].
    fn search<'a>(
        &'a self,
        prune: &mut impl FnMut(&K, &S) -> Visit,
        emit: &mut impl FnMut(&'a K, &'a V),
    ) -> bool {
        match &self.items {
            Items::Leaf(values) => {
                for (k, v) in self.keys.iter().zip(values) {
                    match prune(k, &S::of_entry(k, v)) {
                        Visit::Enter => emit(k, v),
                        Visit::Skip => {}
                        Visit::Stop => return false,
                    }
                }
            }
            Items::Inner { sums, children } => {
                for ((k, s), child) in self.keys.iter().zip(sums).zip(children) {
                    match prune(k, s) {
                        Visit::Enter => {
                            if !child.search(prune, emit) {
                                return false;
                            }
                        }
                        Visit::Skip => {}
                        Visit::Stop => return false,
                    }
                }
            }
        }
        true
    }

    /// Heap bytes of this node and of every node below it.
    fn heap_bytes(&self) -> usize {
        // An `Arc` allocation holds two reference counts beside the node.
        let own = size_of::<Self>() + 2 * size_of::<usize>();
        match &self.items {
            Items::Leaf(_) => own,
            Items::Inner { children, .. } => {
                own + children.iter().map(|c| c.heap_bytes()).sum::<usize>()
            }
        }
    }
}

/// A persistent ordered map from `K` to `V` with a summary `S` of every subtree.
#[derive(Clone)]
pub(crate) struct PTree<K, V, S> {
    root: Option<Arc<Node<K, V, S>>>,
    len: usize,
}

impl<K, V, S> Default for PTree<K, V, S> {
    fn default() -> Self {
        PTree { root: None, len: 0 }
    }
}

impl<K: Ord + Copy, V: Clone, S: Summary<K, V>> PTree<K, V, S> {
    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The entry with the largest key that is at most `key`.
    pub(crate) fn floor(&self, key: &K) -> Option<(&K, &V)> {
        let mut node = self.root.as_deref()?;
        loop {
            match &node.items {
                Items::Inner { children, .. } => {
                    let i = count_prefix(&node.keys, |k| k <= key);
                    node = children.get(i.checked_sub(1)?)?;
                }
                Items::Leaf(values) => {
                    let i = count_prefix(&node.keys, |k| k <= key).checked_sub(1)?;
                    return Some((&node.keys[i], &values[i]));
                }
            }
        }
    }

    /// The value stored under exactly `key`.
    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.floor(key).filter(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Iterates over the entries in key order, starting at the first key at least `from`.
    pub(crate) fn iter_from(&self, from: &K) -> Iter<'_, K, V, S> {
        let mut stack = Vec::new();
        let mut node = self.root.as_deref();
        while let Some(n) = node {
            match &n.items {
                Items::Inner { children, .. } => {
                    let i = child_index(&n.keys, from);
                    stack.push((n, i + 1));
                    node = Some(&children[i]);
                }
                Items::Leaf(_) => {
                    stack.push((n, n.keys.partition_point(|k| k < from)));
                    node = None;
                }
            }
        }
        Iter { stack }
    }

    /// Iterates over all entries in key order.
    pub(crate) fn iter(&self) -> Iter<'_, K, V, S> {
        Iter {
            stack: self.root.as_deref().map(|n| (n, 0)).into_iter().collect(),
        }
    }

    /// Reports, in key order, every entry that a walk pruned by `prune` reaches: `prune` sees
    /// the smallest key and the summary of each subtree (and each entry's key and summary) and
    /// says whether to enter it, skip it or stop.
    pub(crate) fn search<'a>(
        &'a self,
        mut prune: impl FnMut(&K, &S) -> Visit,
        mut emit: impl FnMut(&'a K, &'a V),
    ) {
        if let Some(root) = &self.root {
            root.search(&mut prune, &mut emit);
        }
    }

    /// Heap bytes held by this tree's nodes, shared or not (the values' own heap excluded).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.root.as_ref().map_or(0, |r| r.heap_bytes())
    }

    /// Checks every structural invariant; panics with what is broken. For tests.
    #[cfg(test)]
    pub(crate) fn check(&self)
    where
        K: std::fmt::Debug,
        S: PartialEq + std::fmt::Debug,
    {
        fn walk<K: Ord + Copy + std::fmt::Debug, V: Clone, S>(
            node: &Node<K, V, S>,
            depth: usize,
            leaf_depth: &mut Option<usize>,
        ) -> usize
        where
            S: Summary<K, V> + PartialEq + std::fmt::Debug,
        {
            assert!(node.len() > 0, "empty node below the root");
            assert!(
                node.keys.windows(2).all(|w| w[0] < w[1]),
                "keys out of order"
            );
            match &node.items {
                Items::Leaf(values) => {
                    assert_eq!(values.len(), node.len());
                    assert_eq!(
                        *leaf_depth.get_or_insert(depth),
                        depth,
                        "leaves at two depths"
                    );
                    node.len()
                }
                Items::Inner { sums, children } => {
                    assert_eq!(sums.len(), node.len());
                    assert_eq!(children.len(), node.len());
                    let mut count = 0;
                    for ((k, s), c) in node.keys.iter().zip(sums).zip(children) {
                        assert_eq!(*k, c.keys[0], "inner key is not its child's smallest");
                        assert_eq!(*s, c.summary(), "stale summary");
                        count += walk(c, depth + 1, leaf_depth);
                    }
                    count
                }
            }
        }
        let count = self.root.as_deref().map_or(0, |r| walk(r, 0, &mut None));
        assert_eq!(count, self.len, "length does not match the entries");
        if let Some(root) = &self.root {
            if let Items::Inner { children, .. } = &root.items {
                assert!(children.len() >= 2, "inner root with a single child");
            }
        }
    }
}

/// In-order iterator over a [`PTree`].
pub(crate) struct Iter<'a, K, V, S> {
    /// The nodes from the root down to the current leaf, each with the next position to visit.
    stack: Vec<(&'a Node<K, V, S>, usize)>,
}

impl<'a, K, V, S> Iterator for Iter<'a, K, V, S> {
    type Item = (&'a K, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (node, next) = self.stack.last_mut()?;
            let node: &'a Node<K, V, S> = node;
            let i = *next;
            *next += 1;
            match &node.items {
                Items::Leaf(values) if i < values.len() => {
                    return Some((&node.keys[i], &values[i]));
                }
                Items::Inner { children, .. } if i < children.len() => {
                    self.stack.push((&children[i], 0));
                }
                _ => {
                    self.stack.pop();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Largest value in the subtree: a summary that tests can recompute by hand.
    #[derive(Clone, Copy, Default, Debug, PartialEq)]
    pub(super) struct MaxValue(u64);

    impl Summary<u64, u64> for MaxValue {
        fn of_entry(_: &u64, value: &u64) -> Self {
            MaxValue(*value)
        }
        fn merge(self, other: Self) -> Self {
            MaxValue(self.0.max(other.0))
        }
    }

    pub(super) type Tree = PTree<u64, u64, MaxValue>;

    pub(super) fn pseudo_random(seed: &mut u64) -> u64 {
        // xorshift64: enough spread for shuffling test keys.
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    pub(super) fn assert_same(tree: &Tree, model: &BTreeMap<u64, u64>) {
        tree.check();
        assert_eq!(tree.len(), model.len());
        assert!(tree
            .iter()
            .map(|(k, v)| (*k, *v))
            .eq(model.iter().map(|(k, v)| (*k, *v))));
    }

    #[test]
    fn iter_from_starts_at_the_first_key_not_below() {
        let mut tree = Tree::default();
        for k in (0..2000).map(|k| k * 10) {
            tree.insert(k, k);
        }
        for from in [0, 1, 9, 10, 11, 5555, 19_990, 19_991] {
            let expected: Vec<_> = (0..2000).map(|k| k * 10).filter(|k| *k >= from).collect();
            let got: Vec<_> = tree.iter_from(&from).map(|(k, _)| *k).collect();
            assert_eq!(got, expected, "from {from}");
        }
    }

    #[test]
    fn search_prunes_by_summary_and_stops() {
        let mut tree = Tree::default();
        for k in 0..3000 {
            // Values peak in a few places so that pruning by the maximum matters.
            tree.insert(k, if k % 500 == 7 { 1000 + k } else { k % 100 });
        }
        let mut found = Vec::new();
        let mut entered_leaves = 0;
        tree.search(
            |k, s| {
                if *k >= 2600 {
                    Visit::Stop
                } else if s.0 < 1000 {
                    Visit::Skip
                } else {
                    entered_leaves += 1;
                    Visit::Enter
                }
            },
            |k, _| found.push(*k),
        );
        assert_eq!(found, vec![7, 507, 1007, 1507, 2007, 2507]);
        assert!(
            entered_leaves < 60,
            "pruning entered {entered_leaves} nodes"
        );
    }
}
