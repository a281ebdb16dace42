//! Replaying routing traces through eviction policies, and Belady's offline optimum for
//! comparison. Used by the policy tests and benchmarks; the real store applies the same rules.

use crate::policy::{EvictionPolicy, Key};
use std::collections::{BinaryHeap, HashMap};

/// One layer visit: the MoE layer ordinal and the experts it uses.
pub type Visit = (u32, Vec<u32>);

/// Hits of `policy` with `capacity` slots shared by all layers, the current layer's experts
/// pinned while they are loaded (as the store does).
pub fn replay(policy: &mut dyn EvictionPolicy, capacity: usize, visits: &[Visit]) -> (u64, u64) {
    let mut slot_of: HashMap<Key, usize> = HashMap::new();
    let mut slots: Vec<Option<Key>> = vec![None; capacity];
    let mut free: Vec<usize> = (0..capacity).rev().collect();
    let (mut hits, mut uses) = (0u64, 0u64);
    let mut cand = Vec::new();
    let mut out = Vec::new();
    for (layer, experts) in visits {
        policy.touch(*layer, experts);
        let keys: Vec<Key> = experts.iter().map(|&e| Key { layer: *layer, expert: e }).collect();
        let misses: Vec<Key> = keys.iter().copied().filter(|k| !slot_of.contains_key(k)).collect();
        uses += keys.len() as u64;
        hits += (keys.len() - misses.len()) as u64;
        let need = misses.len().saturating_sub(free.len());
        if need > 0 {
            cand.clear();
            cand.extend(slots.iter().enumerate().filter_map(|(s, k)| k.filter(|k| !keys.contains(k)).map(|k| (s, k))));
            policy.victims(*layer, &cand, need, &mut out);
            for &s in &out {
                slot_of.remove(&slots[s].take().unwrap());
                free.push(s);
            }
        }
        for k in misses {
            let s = free.pop().expect("capacity below one layer's experts");
            slots[s] = Some(k);
            slot_of.insert(k, s);
        }
    }
    (hits, uses)
}

/// Belady's optimum: on a miss with a full cache, evict the resident key used furthest in the
/// future (never the current layer's).
pub fn belady(capacity: usize, visits: &[Visit]) -> (u64, u64) {
    let seq: Vec<Key> = visits.iter().flat_map(|(l, es)| es.iter().map(move |&e| Key { layer: *l, expert: e })).collect();
    let mut next = vec![usize::MAX; seq.len()];
    let mut last: HashMap<Key, usize> = HashMap::new();
    for i in (0..seq.len()).rev() {
        next[i] = *last.get(&seq[i]).unwrap_or(&usize::MAX);
        last.insert(seq[i], i);
    }
    let mut resident: HashMap<Key, usize> = HashMap::new();
    let mut heap: BinaryHeap<(usize, u32, u32)> = BinaryHeap::new();
    let mut hits = 0u64;
    for (i, k) in seq.iter().enumerate() {
        if resident.contains_key(k) {
            hits += 1;
        } else if resident.len() >= capacity {
            while let Some((nu, l, e)) = heap.pop() {
                let kk = Key { layer: l, expert: e };
                if resident.get(&kk) == Some(&nu) {
                    resident.remove(&kk);
                    break;
                }
            }
        }
        resident.insert(*k, next[i]);
        heap.push((next[i], k.layer, k.expert));
    }
    (hits, seq.len() as u64)
}

/// The visits of several sequences decoded together (continuous batching): step by step, each
/// layer's visit is the union of the sequences' experts there, since a batched step reads each
/// expert once for every token that chose it. Each stream is one sequence's visits, all in the
/// same layer order; the batch runs for as many visits as the shortest stream.
pub fn batched(streams: &[Vec<Visit>]) -> Vec<Visit> {
    let len = streams.iter().map(Vec::len).min().unwrap_or(0);
    (0..len)
        .map(|i| {
            let layer = streams[0][i].0;
            let mut experts: Vec<u32> = streams
                .iter()
                .flat_map(|s| {
                    debug_assert_eq!(s[i].0, layer, "streams visit layers in the same order");
                    s[i].1.iter().copied()
                })
                .collect();
            experts.sort_unstable();
            experts.dedup();
            (layer, experts)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Lru;

    #[test]
    fn a_batch_visits_each_layer_once_with_the_union_of_its_experts() {
        let a = vec![(0, vec![1, 2]), (1, vec![3, 4]), (0, vec![1, 5])];
        let b = vec![(0, vec![2, 7]), (1, vec![4, 3])];
        assert_eq!(batched(&[a, b]), vec![(0, vec![1, 2, 7]), (1, vec![3, 4])]);
    }

    #[test]
    fn belady_is_an_upper_bound_on_the_policies() {
        // Three layers cycling over six experts with a cache of four: LRU thrashes on the loop.
        let visits: Vec<Visit> = (0..60u32).map(|i| (i % 3, vec![(i / 3) % 2, 2 + (i / 3) % 2])).collect();
        let (h_lru, u) = replay(&mut Lru::new(3, 4), 4, &visits);
        let (h_opt, u_opt) = belady(4, &visits);
        assert_eq!(u, u_opt);
        assert!(h_opt >= h_lru, "belady {h_opt} < lru {h_lru}");
    }
}
