//! The device's state for snapshots and migration: the sizes the driver reads and which blocks
//! are plugged. The plugged blocks' memory is the manager's (a restore rebuilds its regions,
//! holes and slots from the memory layout, with their ids); a restored device adopts those
//! regions instead of plugging again, and refuses a memory map that does not have exactly
//! what the plugged blocks need in its area: one region per piece with a plugged block, at the
//! piece's place and size, with one slot over the whole piece (or, for an isolated piece or
//! a state saved before pieces kept one slot, the runs of plugged blocks). The unplugged
//! blocks' protection is not in the memory layout: the restore makes them unreachable again.

use std::sync::Arc;

use kvm_memslots::{KvmMemory, MemoryManager, RegionId};
use serde::{Deserialize, Serialize};

use super::config::{Config, Error, VirtioMemOptions};
use super::device::{RequestCounts, VirtioMem};
use super::slots::plugged_runs;

/// What a [`VirtioMem`] saves besides the options it was made with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtioMemState {
    /// The size the device asks the driver to plug.
    pub requested_size: u64,
    /// How much of the region the driver may plug in.
    pub usable_region_size: u64,
    /// The plugged blocks, as `[first, end)` block-index ranges, ascending.
    pub plugged: Vec<[u64; 2]>,
    /// Requests answered, by response: ACK, NACK, BUSY, ERROR.
    pub counts: [u64; 4],
    /// The maximum slot size the device ran with ([`VirtioMemOptions::max_slot_size`]): it
    /// cut the region into the pieces the saved memory holds, so a restore takes it over the
    /// options' (absent from states saved before it was recorded, which the options then
    /// give).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_slot_size: Option<u64>,
}

impl<K: KvmMemory> VirtioMem<K> {
    /// The device's state.
    pub fn state(&self) -> VirtioMemState {
        let mut plugged: Vec<[u64; 2]> = Vec::new();
        for (i, _) in self.blocks.iter().enumerate().filter(|(_, b)| **b) {
            let i = i as u64;
            match plugged.last_mut() {
                Some(run) if run[1] == i => run[1] = i + 1,
                _ => plugged.push([i, i + 1]),
            }
        }
        let RequestCounts {
            ack,
            nack,
            busy,
            error,
        } = self.counts;
        VirtioMemState {
            requested_size: self.config.requested_size(),
            usable_region_size: self.config.usable_region_size(),
            plugged,
            counts: [ack, nack, busy, error],
            max_slot_size: Some(self.config.max_slot_size()),
        }
    }

    /// The device `options` describe, in `state`, over `memory` that already holds the
    /// plugged blocks' regions (restored from a snapshot's layout or received in a
    /// migration), with the state's maximum slot size where it has one. Refused, naming what
    /// is wrong, if the options are inconsistent, the state does not fit them (sizes, block
    /// ranges), or `memory`'s regions in the device's area are not exactly one region per
    /// piece with a plugged block, its slots the piece's runs of plugged blocks.
    pub fn restore(
        memory: Arc<MemoryManager<K>>,
        options: VirtioMemOptions,
        state: &VirtioMemState,
    ) -> Result<Self, Error> {
        let bad = |why: String| Error::State(why);
        let options = VirtioMemOptions {
            max_slot_size: state.max_slot_size.unwrap_or(options.max_slot_size),
            ..options
        };
        let mut config = Config::new(&options)?;
        config.set_requested_size(state.requested_size)?;
        let block = config.block_size();
        let usable = state.usable_region_size;
        let region = config.region();
        if !usable.is_multiple_of(block)
            || usable < state.requested_size
            || usable > region.end - region.start
        {
            return Err(bad(format!(
                "usable region size {usable:#x} is not a multiple of the block size {block:#x} \
                 between the requested size {:#x} and the region size {:#x}",
                state.requested_size,
                region.end - region.start
            )));
        }
        config.set_usable_region_size(usable);
        let usable_blocks = usable / block;
        let mut blocks = vec![false; config.blocks() as usize];
        let mut end = 0;
        for &[first, last] in &state.plugged {
            if first < end || first >= last || last > usable_blocks {
                return Err(bad(format!(
                    "plugged blocks {first}..{last} are not an ascending range inside the \
                     usable region's {usable_blocks} blocks"
                )));
            }
            end = last;
            blocks[first as usize..last as usize].fill(true);
        }
        // The pieces: a region exactly at each piece with a plugged block, its slots the runs
        // of plugged blocks; no other region in the area.
        let per_piece = config.blocks_per_piece();
        let piece_of = |gpa: u64| ((gpa - region.start) / block) as usize / per_piece;
        let mut pieces: Vec<Option<RegionId>> = vec![None; blocks.len().div_ceil(per_piece)];
        let mut isolated = vec![false; pieces.len()];
        for r in memory.regions() {
            if r.gpa.0 >= region.end || r.gpa.0 + r.size <= region.start {
                continue;
            }
            let not_a_piece = || {
                bad(format!(
                    "region {} at {:#x} ({:#x} bytes) lies in the device's area but is not one \
                     of its pieces of {:#x} bytes",
                    r.id,
                    r.gpa.0,
                    r.size,
                    config.max_slot_size()
                ))
            };
            if r.gpa.0 < region.start {
                return Err(not_a_piece());
            }
            let piece = piece_of(r.gpa.0);
            let first = piece * per_piece;
            let last = (first + per_piece).min(blocks.len());
            let piece_gpa = config.block_gpa(first).0;
            if r.gpa.0 != piece_gpa || r.size != (last - first) as u64 * block {
                return Err(not_a_piece());
            }
            let wanted = plugged_runs(blocks[first..last].iter().copied(), block);
            if wanted.is_empty() {
                return Err(bad(format!(
                    "region {} at {:#x} is a piece whose blocks the state says are all unplugged",
                    r.id, r.gpa.0
                )));
            }
            let slots = memory.slot_ranges(r.id).unwrap_or_default();
            let whole: Vec<_> = std::iter::once(0..r.size).collect();
            if slots != whole && slots != wanted {
                return Err(bad(format!(
                    "region {} at {:#x} has slots {slots:x?}; its plugged blocks need \
                     {whole:x?} (or {wanted:x?}, isolated)",
                    r.id, r.gpa.0
                )));
            }
            isolated[piece] = slots != whole;
            pieces[piece] = Some(r.id);
        }
        if let Some(missing) =
            (0..blocks.len()).find(|&i| blocks[i] && pieces[i / per_piece].is_none())
        {
            return Err(bad(format!(
                "block {missing} at {:#x} is plugged, but the memory has no region there",
                config.block_gpa(missing).0
            )));
        }
        // Everything checked: the unplugged blocks of each piece become unreachable again.
        for (piece, region) in pieces.iter().enumerate() {
            let Some(region) = region else { continue };
            let first = piece * per_piece;
            let last = (first + per_piece).min(blocks.len());
            let unplugged = plugged_runs(blocks[first..last].iter().map(|b| !b), block);
            if unplugged.is_empty() {
                continue;
            }
            memory
                .set_accessible(*region, &unplugged, false)
                .map_err(|e| {
                    bad(format!(
                        "making the unplugged blocks of region {region} unreachable: {e}"
                    ))
                })?;
            for range in unplugged {
                let _ = memory.discard_region(*region, range);
            }
        }
        let [ack, nack, busy, error] = state.counts;
        Ok(VirtioMem::from_parts(
            memory,
            config,
            options.queue_size,
            blocks,
            pieces,
            isolated,
            RequestCounts {
                ack,
                nack,
                busy,
                error,
            },
        ))
    }
}
