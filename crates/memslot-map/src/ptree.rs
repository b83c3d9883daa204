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

use std::mem::size_of;
use std::sync::Arc;

use arrayvec::ArrayVec;

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

/// One entry of a node, on its way into a node.
enum Item<K, V, S> {
    Value(V),
    Child(S, Arc<Node<K, V, S>>),
}

// The split-off node is moved straight into an `Arc`; boxing it first would allocate twice.
#[allow(clippy::large_enum_variant)]
enum Inserted<K, V, S> {
    Replaced(V),
    Added,
    /// The node split: the new right sibling must be inserted after it in the parent.
    Split(Node<K, V, S>),
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

    /// Inserts an entry at position `at`; a full node splits first and the right half is
    /// returned.
    fn insert_at(&mut self, at: usize, key: K, item: Item<K, V, S>) -> Option<Self> {
        if self.len() < MAX_FANOUT {
            self.put(at, key, item);
            return None;
        }
        // Appending to a full node (building in key order) keeps this node full and starts
        // the new one with the single new entry; otherwise split in the middle.
        let split = if at == MAX_FANOUT {
            MAX_FANOUT
        } else {
            MAX_FANOUT / 2
        };
        let mut right = self.split_off(split);
        if at <= split && split < MAX_FANOUT {
            self.put(at, key, item);
        } else {
            right.put(at - split, key, item);
        }
        Some(right)
    }

    /// Inserts an entry into a node that has room for it.
    fn put(&mut self, at: usize, key: K, item: Item<K, V, S>) {
        self.keys.insert(at, key);
        match (&mut self.items, item) {
            (Items::Leaf(values), Item::Value(v)) => values.insert(at, v),
            (Items::Inner { sums, children }, Item::Child(s, c)) => {
                sums.insert(at, s);
                children.insert(at, c);
            }
            _ => unreachable!("an entry goes into a node of its own kind"),
        }
    }

    /// Moves entries `at..` into a new node of the same kind.
    fn split_off(&mut self, at: usize) -> Self {
        let keys = self.keys.drain(at..).collect();
        let items = match &mut self.items {
            Items::Leaf(values) => Items::Leaf(values.drain(at..).collect()),
            Items::Inner { sums, children } => Items::Inner {
                sums: sums.drain(at..).collect(),
                children: children.drain(at..).collect(),
            },
        };
        Node { keys, items }
    }

    /// Moves `count` entries from the front of `right` to the back of `self`.
    fn take_front_of(&mut self, right: &mut Self, count: usize) {
        self.keys.extend(right.keys.drain(..count));
        match (&mut self.items, &mut right.items) {
            (Items::Leaf(l), Items::Leaf(r)) => l.extend(r.drain(..count)),
            (
                Items::Inner { sums, children },
                Items::Inner {
                    sums: rsums,
                    children: rchildren,
                },
            ) => {
                sums.extend(rsums.drain(..count));
                children.extend(rchildren.drain(..count));
            }
            _ => unreachable!("siblings are of the same kind"),
        }
    }

    /// Moves `count` entries from the back of `self` to the front of `right`.
    fn give_back_to(&mut self, right: &mut Self, count: usize) {
        let mut moved = self.split_off(self.len() - count);
        moved.take_front_of(right, right.len());
        *right = moved;
    }

    fn insert(&mut self, key: K, value: V) -> Inserted<K, V, S> {
        let Node { keys, items } = self;
        match items {
            Items::Leaf(values) => match keys.binary_search(&key) {
                Ok(i) => Inserted::Replaced(std::mem::replace(&mut values[i], value)),
                Err(i) => match self.insert_at(i, key, Item::Value(value)) {
                    Some(right) => Inserted::Split(right),
                    None => Inserted::Added,
                },
            },
            Items::Inner { sums, children } => {
                let i = child_index(keys, &key);
                let child = Arc::make_mut(&mut children[i]);
                let result = child.insert(key, value);
                keys[i] = child.keys[0];
                sums[i] = child.summary();
                match result {
                    Inserted::Split(right) => {
                        let (rkey, rsum) = (right.keys[0], right.summary());
                        match self.insert_at(i + 1, rkey, Item::Child(rsum, Arc::new(right))) {
                            Some(split) => Inserted::Split(split),
                            None => Inserted::Added,
                        }
                    }
                    other => other,
                }
            }
        }
    }

    /// Removes `key`, which must be present below this node.
    fn remove(&mut self, key: &K) -> Option<V> {
        let Node { keys, items } = self;
        match items {
            Items::Leaf(values) => {
                let i = keys.binary_search(key).ok()?;
                keys.remove(i);
                Some(values.remove(i))
            }
            Items::Inner { sums, children } => {
                let i = child_index(keys, key);
                let child = Arc::make_mut(&mut children[i]);
                let removed = child.remove(key);
                if child.len() == 0 {
                    // The child held the single entry an appending split left it. Drop it:
                    // with no sibling to merge with, `rebalance` would leave it in place, and
                    // its stale key would steer later searches into an empty leaf. If this
                    // node is now underfull, its parent rebalances it.
                    keys.remove(i);
                    sums.remove(i);
                    children.remove(i);
                    return removed;
                }
                keys[i] = child.keys[0];
                sums[i] = child.summary();
                if child.len() < MIN_FANOUT {
                    self.rebalance(i);
                }
                removed
            }
        }
    }

    /// Refills or merges the underfull child `i` with a sibling.
    fn rebalance(&mut self, i: usize) {
        let Node { keys, items } = self;
        let Items::Inner { sums, children } = items else {
            unreachable!("only inner nodes have children to rebalance");
        };
        if children.len() < 2 {
            // No sibling here: this node is underfull too, and its parent rebalances it.
            return;
        }
        let (l, r) = if i > 0 { (i - 1, i) } else { (i, i + 1) };
        let (head, tail) = children.split_at_mut(r);
        let left = Arc::make_mut(&mut head[l]);
        let right = Arc::make_mut(&mut tail[0]);
        let merged = left.even_out(right);
        keys[l] = left.keys[0];
        sums[l] = left.summary();
        if merged {
            keys.remove(r);
            sums.remove(r);
            children.remove(r);
        } else {
            keys[r] = right.keys[0];
            sums[r] = right.summary();
        }
    }

    /// Evens out two neighbouring nodes of one level: moves all of `right` into `self` if they
    /// fit in one node (and returns true: `right` is then empty and must go), or else moves
    /// entries across so that each holds half.
    fn even_out(&mut self, right: &mut Self) -> bool {
        let total = self.len() + right.len();
        if total <= MAX_FANOUT {
            self.take_front_of(right, right.len());
            return true;
        }
        let want_left = total / 2;
        if self.len() < want_left {
            self.take_front_of(right, want_left - self.len());
        } else {
            self.give_back_to(right, self.len() - want_left);
        }
        false
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

/// One write of a batch: `Some` puts the value under the key (adding or replacing), `None`
/// removes the key (if present).
pub(crate) type Write<K, V> = (K, Option<V>);

/// A child as its parent holds it: smallest key, summary, node.
type Entry<K, V, S> = (K, S, Arc<Node<K, V, S>>);

/// Sizes of the nodes that `total` entries are dealt into: as few nodes as hold them, as even
/// as can be, so that each has at least [`MIN_FANOUT`] entries when there are several.
fn chunk_sizes(total: usize) -> impl Iterator<Item = usize> {
    let parts = total.div_ceil(MAX_FANOUT);
    let base = total.checked_div(parts).unwrap_or(0);
    let extra = total.checked_rem(parts).unwrap_or(0);
    (0..parts).map(move |i| base + usize::from(i < extra))
}

impl<K: Ord + Copy, V: Clone, S: Summary<K, V>> Node<K, V, S> {
    fn entry(node: Node<K, V, S>) -> Entry<K, V, S> {
        (node.keys[0], node.summary(), Arc::new(node))
    }

    /// Applies `writes` (sorted by key, each key once, all within this node's key range) to
    /// `this`, adjusting `len` by the entries added and removed, and returns the nodes that
    /// take its place in its parent, in key order: none if it emptied, several if it grew
    /// past [`MAX_FANOUT`]. A returned node may be underfull; the parent mends it with a
    /// sibling.
    ///
    /// A node that no other version shares is changed by moving its entries; a shared one is
    /// copied once, whatever the number of writes below it.
    fn write_sorted(
        this: Arc<Self>,
        writes: &mut [Write<K, V>],
        len: &mut usize,
    ) -> Vec<Entry<K, V, S>> {
        let node = Arc::try_unwrap(this).unwrap_or_else(|shared| (*shared).clone());
        let Node { keys, items } = node;
        match items {
            Items::Leaf(values) => {
                let mut merged: Vec<(K, V)> = Vec::with_capacity(keys.len() + writes.len());
                let mut old = keys.into_iter().zip(values).peekable();
                for (key, write) in writes.iter_mut() {
                    while let Some(entry) = old.next_if(|(k, _)| k < key) {
                        merged.push(entry);
                    }
                    let existed = old.next_if(|(k, _)| k == key).is_some();
                    match (write.take(), existed) {
                        (Some(value), existed) => {
                            *len += usize::from(!existed);
                            merged.push((*key, value));
                        }
                        (None, true) => *len -= 1,
                        (None, false) => {}
                    }
                }
                merged.extend(old);
                let mut merged = merged.into_iter();
                chunk_sizes(merged.len())
                    .map(|size| {
                        let mut node = Node::leaf();
                        let Items::Leaf(values) = &mut node.items else {
                            unreachable!("a new leaf")
                        };
                        for (k, v) in merged.by_ref().take(size) {
                            node.keys.push(k);
                            values.push(v);
                        }
                        Node::entry(node)
                    })
                    .collect()
            }
            Items::Inner { sums, children } => {
                let count = children.len();
                let mut list: Vec<Entry<K, V, S>> = Vec::with_capacity(count + 2);
                let mut rest = writes;
                for (i, (sum, child)) in sums.into_iter().zip(children).enumerate() {
                    // Child `i` holds the keys below the next child's smallest key (the first
                    // child also those below its own).
                    let mine = match keys.get(i + 1) {
                        Some(next) => rest.partition_point(|(k, _)| k < next),
                        None => rest.len(),
                    };
                    let (here, after) = std::mem::take(&mut rest).split_at_mut(mine);
                    rest = after;
                    if here.is_empty() {
                        list.push((keys[i], sum, child));
                    } else {
                        list.extend(Node::write_sorted(child, here, len));
                    }
                }
                mend(&mut list);
                inner_nodes(list)
            }
        }
    }
}

/// Merges or refills every underfull node of `list` (siblings, in key order) with a neighbour,
/// as a removal's `rebalance` does, until each has at least [`MIN_FANOUT`] entries or is alone.
fn mend<K: Ord + Copy, V: Clone, S: Summary<K, V>>(list: &mut Vec<Entry<K, V, S>>) {
    let mut i = 0;
    while i < list.len() {
        if list.len() < 2 || list[i].2.len() >= MIN_FANOUT {
            i += 1;
            continue;
        }
        let l = if i + 1 < list.len() { i } else { i - 1 };
        let (head, tail) = list.split_at_mut(l + 1);
        let (left, right) = (&mut head[l], &mut tail[0]);
        let (left_node, right_node) = (Arc::make_mut(&mut left.2), Arc::make_mut(&mut right.2));
        let merged = left_node.even_out(right_node);
        (left.0, left.1) = (left_node.keys[0], left_node.summary());
        if merged {
            list.remove(l + 1);
            // The merged node may still be underfull: look at it again.
            i = l;
            continue;
        }
        (right.0, right.1) = (right_node.keys[0], right_node.summary());
        i += 1;
    }
}

/// Deals `list` (children in key order) into as few inner nodes as hold them.
fn inner_nodes<K: Ord + Copy, V: Clone, S: Summary<K, V>>(
    list: Vec<Entry<K, V, S>>,
) -> Vec<Entry<K, V, S>> {
    let mut list = list.into_iter();
    chunk_sizes(list.len())
        .map(|size| {
            let mut keys = ArrayVec::new();
            let mut sums = ArrayVec::new();
            let mut children = ArrayVec::new();
            for (k, s, c) in list.by_ref().take(size) {
                keys.push(k);
                sums.push(s);
                children.push(c);
            }
            Node::entry(Node {
                keys,
                items: Items::Inner { sums, children },
            })
        })
        .collect()
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
                    let i = node.keys.partition_point(|k| k <= key);
                    node = children.get(i.checked_sub(1)?)?;
                }
                Items::Leaf(values) => {
                    let i = node.keys.partition_point(|k| k <= key).checked_sub(1)?;
                    return Some((&node.keys[i], &values[i]));
                }
            }
        }
    }

    /// The value stored under exactly `key`.
    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.floor(key).filter(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Inserts or replaces the value under `key`; returns the value it replaced.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        let Some(root) = self.root.as_mut() else {
            let mut leaf = Node::leaf();
            leaf.put(0, key, Item::Value(value));
            self.root = Some(Arc::new(leaf));
            self.len = 1;
            return None;
        };
        match Arc::make_mut(root).insert(key, value) {
            Inserted::Replaced(old) => Some(old),
            Inserted::Added => {
                self.len += 1;
                None
            }
            Inserted::Split(right) => {
                let left = Arc::clone(root);
                let mut keys = ArrayVec::new();
                let mut sums = ArrayVec::new();
                let mut children = ArrayVec::new();
                keys.extend([left.keys[0], right.keys[0]]);
                sums.extend([left.summary(), right.summary()]);
                children.extend([left, Arc::new(right)]);
                self.root = Some(Arc::new(Node {
                    keys,
                    items: Items::Inner { sums, children },
                }));
                self.len += 1;
                None
            }
        }
    }

    /// Removes the entry under `key`; returns its value.
    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        // Look first so that removing an absent key copies no shared node.
        self.get(key)?;
        let root = self.root.as_mut()?;
        let removed = Arc::make_mut(root).remove(key);
        self.len -= 1;
        // Drop levels that have a single child, and the root leaf once it is empty.
        while let Some(root) = &self.root {
            match &root.items {
                Items::Inner { children, .. } if children.len() == 1 => {
                    self.root = Some(Arc::clone(&children[0]));
                }
                Items::Leaf(_) if root.len() == 0 => self.root = None,
                _ => break,
            }
        }
        removed
    }

    /// Applies `writes`, sorted by key with each key once, in one pass down the tree: each
    /// node on the way to a written key is visited (and, if shared, copied) once, rather than
    /// once per write as with [`insert`](Self::insert) and [`remove`](Self::remove). Removing
    /// an absent key does nothing. The values of `writes` are taken.
    pub(crate) fn write_sorted(&mut self, writes: &mut [Write<K, V>]) {
        debug_assert!(
            writes.windows(2).all(|w| w[0].0 < w[1].0),
            "unsorted writes"
        );
        if writes.is_empty() {
            return;
        }
        let root = self.root.take().unwrap_or_else(|| Arc::new(Node::leaf()));
        let mut level = Node::write_sorted(root, writes, &mut self.len);
        // The root's replacements are at least half full each when there are several: give
        // them parents until one node holds them all.
        while level.len() > 1 {
            level = inner_nodes(level);
        }
        self.root = level.pop().map(|(_, _, node)| node);
        // Drop levels that have a single child.
        while let Some(root) = &self.root {
            match &root.items {
                Items::Inner { children, .. } if children.len() == 1 => {
                    self.root = Some(Arc::clone(&children[0]));
                }
                _ => break,
            }
        }
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
    struct MaxValue(u64);

    impl Summary<u64, u64> for MaxValue {
        fn of_entry(_: &u64, value: &u64) -> Self {
            MaxValue(*value)
        }
        fn merge(self, other: Self) -> Self {
            MaxValue(self.0.max(other.0))
        }
    }

    type Tree = PTree<u64, u64, MaxValue>;

    fn pseudo_random(seed: &mut u64) -> u64 {
        // xorshift64: enough spread for shuffling test keys.
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn assert_same(tree: &Tree, model: &BTreeMap<u64, u64>) {
        tree.check();
        assert_eq!(tree.len(), model.len());
        assert!(tree
            .iter()
            .map(|(k, v)| (*k, *v))
            .eq(model.iter().map(|(k, v)| (*k, *v))));
    }

    #[test]
    fn ascending_build_fills_nodes_and_keeps_invariants() {
        let mut tree = Tree::default();
        let mut model = BTreeMap::new();
        for k in 0..5000 {
            assert_eq!(tree.insert(k * 2, k), None);
            model.insert(k * 2, k);
        }
        assert_same(&tree, &model);
        // Appending keeps leaves full: about n / MAX_FANOUT leaves, not 2n / MAX_FANOUT.
        let leaf_bytes = size_of::<Node<u64, u64, MaxValue>>() + 2 * size_of::<usize>();
        let leaves_upper_bound = 5000 / MAX_FANOUT + 2;
        assert!(tree.heap_bytes() < leaf_bytes * (leaves_upper_bound + leaves_upper_bound / 8));
        assert_eq!(tree.floor(&7), Some((&6, &3)));
        assert_eq!(tree.floor(&8), Some((&8, &4)));
        assert_eq!(tree.get(&7), None);
        assert_eq!(tree.floor(&u64::MAX), Some((&9998, &4999)));
    }

    #[test]
    fn random_inserts_and_removes_match_btreemap() {
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        let mut tree = Tree::default();
        let mut model = BTreeMap::new();
        for round in 0..20_000 {
            let key = pseudo_random(&mut seed) % 3000;
            if pseudo_random(&mut seed) % 3 == 0 {
                assert_eq!(tree.remove(&key), model.remove(&key));
            } else {
                assert_eq!(tree.insert(key, round), model.insert(key, round));
            }
            if round % 997 == 0 {
                assert_same(&tree, &model);
            }
        }
        assert_same(&tree, &model);
        for key in model.keys().copied().collect::<Vec<_>>() {
            assert_eq!(tree.remove(&key), model.remove(&key));
        }
        assert_same(&tree, &model);
        assert!(tree.root.is_none());
    }

    /// Applies `writes` to both the tree and the model, checking the old version stays whole.
    fn write_both(
        tree: &mut Tree,
        model: &mut BTreeMap<u64, u64>,
        mut writes: Vec<Write<u64, u64>>,
    ) {
        let before = tree.clone();
        let before_model = model.clone();
        for (k, v) in &writes {
            match v {
                Some(v) => model.insert(*k, *v),
                None => model.remove(k),
            };
        }
        tree.write_sorted(&mut writes);
        assert_same(tree, model);
        assert_same(&before, &before_model);
    }

    #[test]
    fn sorted_batches_match_btreemap() {
        let mut seed = 0x2545_f491_4f6c_dd1d;
        let mut tree = Tree::default();
        let mut model = BTreeMap::new();
        for round in 0..400u64 {
            // Runs of neighbouring keys (as a region's slots are) or keys spread over the range,
            // of every size from one write to several leaves' worth; puts, removes or both.
            let size = 1 + (pseudo_random(&mut seed) % 300) as usize;
            let start = pseudo_random(&mut seed) % 5000;
            let spread = 1 + pseudo_random(&mut seed) % 4;
            let mode = pseudo_random(&mut seed) % 3;
            let mut keys: Vec<u64> = (0..size as u64).map(|i| start + i * spread).collect();
            if round % 5 == 0 {
                keys = (0..size).map(|_| pseudo_random(&mut seed) % 6000).collect();
                keys.sort_unstable();
                keys.dedup();
            }
            let writes = keys
                .into_iter()
                .map(|k| {
                    let put = match mode {
                        0 => true,
                        1 => false,
                        _ => pseudo_random(&mut seed) % 2 == 0,
                    };
                    (k, put.then_some(round))
                })
                .collect();
            write_both(&mut tree, &mut model, writes);
        }
        // Empty it in one batch, then fill an empty tree in one.
        let all = model.keys().map(|k| (*k, None)).collect();
        write_both(&mut tree, &mut model, all);
        assert!(tree.root.is_none());
        let fill = (0..10_000).map(|k| (k, Some(k))).collect();
        write_both(&mut tree, &mut model, fill);
        // Filling in key order leaves nodes full, as ascending inserts do.
        let leaf_bytes = size_of::<Node<u64, u64, MaxValue>>() + 2 * size_of::<usize>();
        let leaves_upper_bound = 10_000 / MAX_FANOUT + 2;
        assert!(tree.heap_bytes() < leaf_bytes * (leaves_upper_bound + leaves_upper_bound / 8));
    }

    #[test]
    fn sorted_batch_copies_each_shared_node_once() {
        let mut v1 = Tree::default();
        for k in 0..32 * 1024 {
            v1.insert(k, k);
        }
        let mut v2 = v1.clone();
        // Replace 1024 neighbouring values: 32 leaves and the inner nodes above them.
        let mut writes: Vec<_> = (5000..6024).map(|k| (k, Some(k + 1))).collect();
        v2.write_sorted(&mut writes);
        v2.check();
        let nodes = |t: &Tree| {
            let mut out = Vec::new();
            let mut stack = vec![t.root.clone().expect("non-empty")];
            while let Some(n) = stack.pop() {
                out.push(Arc::as_ptr(&n));
                if let Items::Inner { children, .. } = &n.items {
                    stack.extend(children.iter().cloned());
                }
            }
            out
        };
        let old: std::collections::HashSet<_> = nodes(&v1).into_iter().collect();
        let copied = nodes(&v2).iter().filter(|p| !old.contains(p)).count();
        assert!(
            copied <= 34 + 4,
            "{copied} nodes copied for 1024 neighbouring writes"
        );
        assert_eq!(v1.get(&5000), Some(&5000));
        assert_eq!(v2.get(&5000), Some(&5001));
    }

    #[test]
    fn versions_share_structure_and_stay_unchanged() {
        let mut v1 = Tree::default();
        for k in 0..10_000 {
            v1.insert(k, k);
        }
        let snapshot: Vec<_> = v1.iter().map(|(k, v)| (*k, *v)).collect();
        let mut v2 = v1.clone();
        v2.insert(20_000, 1);
        v2.remove(&5000);
        v2.insert(17, 99);
        // The old version is untouched.
        assert!(v1
            .iter()
            .map(|(k, v)| (*k, *v))
            .eq(snapshot.iter().copied()));
        v1.check();
        v2.check();
        assert_eq!(v2.get(&17), Some(&99));
        assert_eq!(v1.get(&17), Some(&17));
        // Only the changed paths were copied: most leaves are the same allocation in both.
        let leaves = |t: &Tree| {
            let mut out = Vec::new();
            let mut stack = vec![t.root.clone().expect("non-empty")];
            while let Some(n) = stack.pop() {
                match &n.items {
                    Items::Leaf(_) => out.push(Arc::as_ptr(&n)),
                    Items::Inner { children, .. } => stack.extend(children.iter().cloned()),
                }
            }
            out
        };
        let old: std::collections::HashSet<_> = leaves(&v1).into_iter().collect();
        let new = leaves(&v2);
        let copied = new.iter().filter(|p| !old.contains(p)).count();
        assert!(copied <= 4, "{copied} leaves copied for three changes");
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
