//! Single-key changes to a [`PTree`]: insert and remove, with the node splits an insert makes
//! and the rebalancing (merging or refilling underfull nodes) a removal needs.

use std::sync::Arc;

use arrayvec::ArrayVec;

use super::{child_index, Items, Node, PTree, Summary, MAX_FANOUT, MIN_FANOUT};

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

impl<K: Ord + Copy, V: Clone, S: Summary<K, V>> Node<K, V, S> {
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
    pub(super) fn even_out(&mut self, right: &mut Self) -> bool {
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
}

impl<K: Ord + Copy, V: Clone, S: Summary<K, V>> PTree<K, V, S> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptree::tests::{assert_same, pseudo_random, MaxValue, Tree};
    use std::collections::BTreeMap;
    use std::mem::size_of;

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
            if pseudo_random(&mut seed).is_multiple_of(3) {
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
}
