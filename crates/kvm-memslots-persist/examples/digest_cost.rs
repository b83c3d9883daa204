//! What the stream's end-to-end check costs: the sender's digest while it sends, and the
//! receiver's check of its memory. Prints figures per GiB (docs/BENCHMARKS.md has them).
//!
//!     cargo run --release -p kvm-memslots-persist --example digest_cost [MIB] [RUNS]
//!
//! Memory: one region of MIB MiB (1024 by default) whose every page holds data (a counter per
//! u64, so no page is zeros and none repeats), on kvm-memslots' KVM model (no /dev/kvm needed).
//! For each of RUNS runs (5 by default; the median is printed):
//! - `send_all`: a stream's first round of the whole region into `io::sink()`, with the digest
//!   as every send keeps it (reading guest memory, framing, CRC-32, and the digest);
//! - `page_hash`: the digest's own part of that, the hash of every page alone (from a buffer
//!   already read);
//! - `check`: the receiver's `MemoryDigest::of_memory` of the same memory (reading it back
//!   from guest memory and hashing it), and of a region of the same size that holds no data
//!   (what the scan for data costs alone).

use std::time::{Duration, Instant};

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{MemoryManager, RegionSpec, PAGE_SIZE};
use kvm_memslots_persist::stream::{page_hash, MemoryDigest, StreamWriter};
use kvm_memslots_persist::MemoryLayout;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().map_or(Ok(1024), |a| a.parse())?;
    let runs: usize = args.next().map_or(Ok(5), |a| a.parse())?;
    if mib == 0 || runs == 0 {
        return Err("MIB and RUNS must be at least 1".into());
    }
    let size = mib * MIB;
    let per_gib = |d: Duration| d.as_secs_f64() * 1e3 * (1024.0 / mib as f64);

    let full = MemoryManager::new(FakeKvm::new(64, true));
    full.add_region(RegionSpec::new(GuestAddress(0), size))?;
    let ram = full.handle().memory();
    let mut chunk = vec![0u8; MIB as usize];
    for at in (0..size).step_by(MIB as usize) {
        for (i, word) in chunk.chunks_exact_mut(8).enumerate() {
            word.copy_from_slice(&(at / 8 + i as u64 + 1).to_le_bytes());
        }
        ram.write_slice(&chunk, GuestAddress(at))?;
    }
    let layout = MemoryLayout::of(&full);
    let empty = MemoryManager::new(FakeKvm::new(64, true));
    empty.add_region(RegionSpec::new(GuestAddress(0), size))?;
    let empty_layout = MemoryLayout::of(&empty);

    let (mut send, mut hash, mut check, mut scan) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let mut writer = StreamWriter::new(std::io::sink());
        writer.hello(&layout)?;
        let started = Instant::now();
        writer.send_all(&full)?;
        send.push(started.elapsed());
        let sent = writer.digest();

        let mut sum = 0u64;
        let started = Instant::now();
        for at in (0..size).step_by(MIB as usize) {
            ram.read_slice(&mut chunk, GuestAddress(at))?;
            for (i, page) in chunk.chunks_exact(PAGE_SIZE as usize).enumerate() {
                sum = sum.wrapping_add(page_hash(at + i as u64 * PAGE_SIZE, page));
            }
        }
        let with_reads = started.elapsed();
        let started = Instant::now();
        for at in (0..size).step_by(MIB as usize) {
            ram.read_slice(&mut chunk, GuestAddress(at))?;
        }
        hash.push(with_reads.saturating_sub(started.elapsed()));
        assert_eq!(sum, sent.regions[0].sum, "the same pages, the same digest");

        let started = Instant::now();
        let here = MemoryDigest::of_memory(&full, &layout, &[])?;
        check.push(started.elapsed());
        here.check(&sent, &layout)?;
        let started = Instant::now();
        MemoryDigest::of_memory(&empty, &empty_layout, &[])?;
        scan.push(started.elapsed());
    }
    println!("{mib} MiB, every page data, median of {runs} runs (ms per GiB):");
    println!(
        "  source: send_all into a sink  {:8.1}",
        per_gib(median(send))
    );
    println!(
        "  source: page_hash alone       {:8.1}",
        per_gib(median(hash))
    );
    println!(
        "  source: page table            {:8.1} MiB per GiB of region",
        8.0 * 1024.0 / PAGE_SIZE as f64
    );
    println!(
        "  destination: check            {:8.1}",
        per_gib(median(check))
    );
    println!(
        "  destination: check, no data   {:8.1}",
        per_gib(median(scan))
    );
    Ok(())
}
