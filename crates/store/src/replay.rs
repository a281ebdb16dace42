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
