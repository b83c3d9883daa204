//! Batch writes to a [`PTree`]: [`PTree::write_sorted`] applies many sorted writes in one pass
//! down the tree, deals the entries of each changed node into as few even nodes as hold them,
//! and mends underfull ones with a neighbour.

use std::sync::Arc;

use arrayvec::ArrayVec;

use super::{Items, Node, PTree, Summary, MAX_FANOUT, MIN_FANOUT};

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

impl<K: Ord + Copy, V: Clone, S: Summary<K, V>> PTree<K, V, S> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptree::tests::{assert_same, pseudo_random, MaxValue, Tree};
    use std::collections::BTreeMap;
    use std::mem::size_of;

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
                        _ => pseudo_random(&mut seed).is_multiple_of(2),
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
}
