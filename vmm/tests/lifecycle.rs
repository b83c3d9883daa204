//! The lifecycle model test: `tinyvmm` processes driven through random, seeded sequences over
//! the whole lifecycle graph, every VM held to a reference model of its memory.
//!
//! The model is what the test guest's area holds: the area is cut into chunks, and the model
//! says which seed each chunk was last written with (the guest's `write` stores `a ^ seed` at
//! every page's address `a`, and `verify` checks that). A sequence starts with `serve` and
//! takes steps at random: guest writes, pause and resume, paused Full and Diff snapshots, live
//! Full and Diff snapshots (completed, or cancelled at once or after a moment), restores of any
//! snapshot taken so far (the Fulls, and every Diff's merged chain) with every memory backend
//! (copy, file, uffd, uffd with a recorded working set prefetched), migrations to a `tinyvmm
//! receive` (over a Unix socket or TCP, to a destination logging with a bitmap or a ring,
//! local handover; completed or cancelled), region changes (add, remove, move, read-only and
//! back, writes refused where read-only), the hotplug area (configured, plugged and unplugged
//! to random sizes), client harvests of the dirty log, two clones of one snapshot side by side
//! (each written and checked on its own, then a third that must hold none of their writes),
//! snapshots with their memory file on a hugetlbfs mount now and then (a Full of a VM on the
//! 2 MiB grid there is a template: restored or cloned from, by the file backend half the time,
//! each file clone mapping it privately in 2 MiB pages and reserving them in the pool, refused
//! by name where the pool cannot; a Diff there is refused by name; the template variant is
//! skipped loudly where the pool is short or no mount can be made), the VM's end (Stop,
//! SIGTERM, SIGTERM in a live Full) followed by a restore, and migrations of a guest writing in
//! a loop all along (no downtime allowed: the timeout forces the pause or cancels, as
//! `on_timeout` says). The initial memory and the hotplug area take 4 KiB, 2 MiB hugetlb or
//! transparent huge pages per sequence, and each added region its own; `GET /memory` must
//! report each region's page size as the model says (kept by every path, but a file restore
//! maps transparent huge pages in 4 KiB pages, refuses 2 MiB ones off hugetlbfs, and maps every
//! region of a template on hugetlbfs in 2 MiB pages). After every step the current VM's whole
//! area is verified against the model, and every answer is held to what the model says must
//! happen (a Diff with no Full before it in this VM's chain is refused, and so on).
//!
//! A failure names the seed and the step, and prints the command that replays it:
//! `LIFECYCLE_SEED=S LIFECYCLE_STEPS=N cargo test --profile test-release -p tinyvmm --test
//! lifecycle -- --ignored --nocapture replay`. CI runs a fixed set of seeds
//! ([`CI_SEEDS`]); a soak runs fresh seeds for as long as asked:
//! `LIFECYCLE_SOAK_SECS=3600 cargo test --profile test-release -p tinyvmm --test lifecycle --
//! --ignored --nocapture soak`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tinyvmm::api::client::Client;

mod support;
use support::vmm::Vmm;
use support::HugetlbfsMount;

const MIB: u64 = 1 << 20;
/// Where `serve` puts its initial memory.
const AREA: u64 = 256 * MIB;
/// The guest memory each VM starts with, and its slots.
const MEM_MIB: u64 = 16;
const SLOTS: &str = "64";
/// The model's unit: the area is this many chunks.
const CHUNKS: usize = 16;
/// Steps a CI sequence takes.
const CI_STEPS: usize = 25;
/// The seeds CI runs (fixed, so that a failure in CI replays anywhere).
const CI_SEEDS: [u64; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

/// A small, seeded generator (xorshift64*): the sequence is the seed's alone.
struct Rng(u64);

impl Rng {
    /// Seeded through splitmix64, so that neighbouring seeds start far apart.
    fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// What a VM's memory holds: the seed of each chunk of the area, and the regions the sequence
/// added (each written whole with one seed).
#[derive(Debug, Clone, Default)]
struct Model {
    area: Vec<u64>,
    extra: Vec<Extra>,
    /// The hotplug area's plugged blocks (from its start), each written whole with one seed;
    /// empty until the sequence configures the area (`None` then: no area).
    plugged: Option<Vec<u64>>,
    /// The page size of the initial memory (`serve --page-size`) and of the hotplug area
    /// configured in this VM (`"page_size"`).
    page: Page,
}

/// A region's page size, as the model expects `GET /memory` to report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Page {
    /// 4 KiB pages.
    #[default]
    Base,
    /// 2 MiB hugetlb pages.
    Huge,
    /// Transparent huge pages.
    Thp,
}

impl Page {
    /// The API's word for it.
    fn name(self) -> &'static str {
        match self {
            Page::Base => "4k",
            Page::Huge => "2m",
            Page::Thp => "thp",
        }
    }

    /// What it becomes in a file restore: a private mapping of a file (not on hugetlbfs) has
    /// no transparent huge pages, so a THP region maps in 4 KiB pages (and says so).
    fn in_file_restore(self) -> Page {
        match self {
            Page::Thp => Page::Base,
            page => page,
        }
    }
}

impl Model {
    /// The model of a VM restored from a snapshot of this one with `backend`, its memory file
    /// a template on hugetlbfs if `template`: mapped privately from there, every region is in
    /// 2 MiB pages.
    fn restored_with(&self, backend: &str, template: bool) -> Model {
        let mut model = self.clone();
        if backend == "file" {
            let page = |page: Page| {
                if template {
                    Page::Huge
                } else {
                    page.in_file_restore()
                }
            };
            model.page = page(model.page);
            for extra in &mut model.extra {
                extra.page = page(extra.page);
            }
        }
        model
    }

    /// Whether every region and slot of the VM is on the 2 MiB grid, as a template on
    /// hugetlbfs must be for its clones to map it in 2 MiB pages: the initial memory of 2 MiB
    /// pages (served in slots of whole pages), and every added region in slots of its size
    /// (the hotplug area's pieces and blocks are whole pages).
    fn on_2m_grid(&self) -> bool {
        self.page == Page::Huge && self.extra.iter().all(|e| e.slot_size == EXTRA_SIZE)
    }
}

/// The hotplug area the sequence configures: blocks of [`BLOCK_MIB`], pieces (slots) of
/// [`PIECE_MIB`], [`HOTPLUG_MIB`] in all: four whole pieces and a last one of half a piece, so
/// that snapshots, restores and migrations carry a shorter last piece too.
const HOTPLUG_MIB: u64 = 36;
const BLOCK_MIB: u64 = 2;
const PIECE_MIB: u64 = 8;

/// A region the sequence added.
#[derive(Debug, Clone)]
struct Extra {
    gpa: u64,
    seed: u64,
    read_only: bool,
    /// Its page size (`"page_size"`).
    page: Page,
    /// Its slots' size (`"slot_size"`).
    slot_size: u64,
}

/// Where added regions go: places of [`EXTRA_SIZE`] from 1 GiB up, [`EXTRA_PLACES`] of them.
const EXTRA_BASE: u64 = 1 << 30;
const EXTRA_SIZE: u64 = 2 * MIB;
const EXTRA_PLACES: u64 = 8;
const EXTRA_STRIDE: u64 = 8 * MIB;

/// The restore backends (`--mem-backend`; `uffd-prefetch`: uffd with the snapshot's recorded
/// working set prefetched, recorded on its first restore).
const BACKENDS: [&str; 4] = ["copy", "file", "uffd", "uffd-prefetch"];

/// How a VM's memory came to it, for the log.
#[derive(Debug, Clone)]
struct Origin(String);

/// A snapshot the sequence took: the state file, the memory file to restore it with (a Full's
/// own, or a Diff's merged chain) and the model at its point.
#[derive(Debug, Clone)]
struct Saved {
    name: String,
    state: PathBuf,
    mem: PathBuf,
    model: Model,
    /// The VM was started with `--dirty-ring`, which a restore keeps.
    ring: bool,
    /// The memory file is a Full's on the hugetlbfs mount: a template whose file clones map it
    /// privately in 2 MiB pages, each reserving its 2 MiB pages ([`pages`](Self::pages)) in
    /// the pool.
    template: bool,
    /// The memory file's size in 2 MiB pages.
    pages: u64,
}

/// `tinyvmm ARGS` named `name`, its API socket and its stderr (`NAME.stderr`) in `dir`.
fn spawn(dir: &Path, name: &str, args: &[&str]) -> Vmm {
    Vmm::command(name)
        .api_sock(dir.join(format!("{name}.sock")))
        .stderr_file(dir.join(format!("{name}.stderr")))
        .args(args)
        .spawn()
}

/// How long a VMM may take to exit once asked (a hang guard only).
const EXIT_LIMIT: Duration = Duration::from_secs(120);

/// Waits for `vmm` to exit (it was asked to); its status.
fn exited(vmm: &mut Vmm) -> Option<i32> {
    vmm.wait(EXIT_LIMIT).status.code()
}

/// Sends `vmm` SIGTERM and waits for it to exit; its status.
fn terminate(vmm: &mut Vmm) -> Option<i32> {
    vmm.signal(libc::SIGTERM);
    exited(vmm)
}

/// Stops `vmm` (`PUT /actions` Stop, whatever the answer: a VMM that does not answer any more
/// is ended all the same) unless it has ended already.
fn stop(mut vmm: Vmm) {
    if !vmm.running() {
        return;
    }
    let stop = json!({"action_type": "Stop"});
    let _ = Client::connect(vmm.api()).and_then(|mut c| c.call("PUT", "/actions", Some(&stop)));
    exited(&mut vmm);
}

/// The VM a sequence drives now, and what the model says of it.
struct Vm {
    process: Vmm,
    model: Model,
    paused: bool,
    ring: bool,
    origin: Origin,
    /// This VM's snapshot chain since its last Full: (state, memory) files; none before a Full.
    chain: Option<Vec<(PathBuf, PathBuf)>>,
}

/// One sequence: its seed, its scratch folder, the VM and every snapshot taken.
struct Sequence {
    seed: u64,
    rng: Rng,
    dir: PathBuf,
    vm: Vm,
    saved: Vec<Saved>,
    steps: Vec<String>,
    names: usize,
    chunk: u64,
    next_seed: u64,
    /// Where snapshots put their memory file now and then (`None`: no mount, said once).
    hugetlbfs: Option<HugetlbfsMount>,
    /// The draws of the hugetlbfs variants, from a generator of their own so that the
    /// sequence's other draws stay what they were.
    places: Rng,
}

impl Sequence {
    fn start(seed: u64) -> Sequence {
        let dir =
            std::env::temp_dir().join(format!("tinyvmm-lifecycle-{}-{seed}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        let mut rng = Rng::new(seed);
        let ring = rng.chance(30);
        let memfd = rng.chance(50);
        let mem = MEM_MIB.to_string();
        // From a generator of its own, so that the sequence's draws stay what they were.
        let mut sizes = Rng::new(!seed);
        let page = if sizes.chance(30) && kvm_memslots::hugetlb_pages_available() >= 64 {
            Page::Huge
        } else if sizes.chance(30) {
            Page::Thp
        } else {
            Page::Base
        };
        // 2 MiB pages take slots of whole pages: 8 of 2 MiB.
        let slots = if page == Page::Huge { "9" } else { SLOTS };
        let mut args = vec!["serve", "--slots", slots, "--mem-mib", &mem];
        if page != Page::Base {
            args.extend(["--page-size", page.name()]);
        }
        if ring {
            args.extend(["--dirty-ring", "4096"]);
        }
        if memfd {
            args.push("--memfd");
        }
        let hugetlbfs = match HugetlbfsMount::mount(dir.join("hugetlbfs")) {
            Ok(mount) => Some(mount),
            Err(why) => {
                eprintln!(
                    "SKIPPED lifecycle seed {seed}: templates on hugetlbfs and Diffs refused \
                     there: cannot mount hugetlbfs: {why} (the test needs root)"
                );
                None
            }
        };
        let process = spawn(&dir, "vm0", &args);
        process.try_wait_for_vm().expect("serve runs");
        let end = support::area_end(process.api(), AREA);
        let chunk = (end - AREA) / CHUNKS as u64 / 4096 * 4096;
        let mut sequence = Sequence {
            seed,
            rng,
            dir,
            vm: Vm {
                process,
                model: Model {
                    area: vec![0; CHUNKS],
                    extra: Vec::new(),
                    plugged: None,
                    page,
                },
                paused: false,
                ring,
                origin: Origin(format!("serve {}", args[1..].join(" "))),
                chain: None,
            },
            saved: Vec::new(),
            steps: Vec::new(),
            names: 1,
            chunk,
            next_seed: seed << 32,
            hugetlbfs,
            places: Rng::new(seed.rotate_left(32)),
        };
        // Every chunk holds a seed from the start, so that every check has one to expect.
        sequence.note(format!(
            "{} (ring {ring}, memfd {memfd})",
            sequence.vm.origin.0
        ));
        sequence.write(0, CHUNKS);
        sequence
    }

    fn name(&mut self, what: &str) -> String {
        self.names += 1;
        format!("{what}{}", self.names)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn note(&mut self, step: String) {
        eprintln!(
            "lifecycle seed {} step {}: {step}",
            self.seed,
            self.steps.len()
        );
        self.steps.push(step);
    }

    /// Fails the sequence, naming the seed, the steps so far and the replay command.
    fn fail(&self, why: &str) -> ! {
        panic!(
            "lifecycle seed {} failed at step {}: {why}\nsteps:\n  {}\nreplay: LIFECYCLE_SEED={} \
             LIFECYCLE_STEPS={} cargo test --profile test-release -p tinyvmm --test lifecycle \
             -- --ignored --nocapture replay\n(the VMs' stderr: {})",
            self.seed,
            self.steps.len() - 1,
            self.steps.join("\n  "),
            self.seed,
            self.steps.len(),
            self.dir.display()
        )
    }

    /// A request to the VM; a VMM that does not answer fails the sequence with how its
    /// process ended.
    fn call(&mut self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let answer = Client::connect(self.vm.process.api())
            .and_then(|mut c| c.call(method, path, body.as_ref()));
        match answer {
            Ok(answer) => answer,
            Err(e) => {
                std::thread::sleep(Duration::from_millis(200));
                let ended = match self.vm.process.try_exited() {
                    Some(output) => format!("it ended: {:?}", output.status),
                    None => "it still runs".to_owned(),
                };
                self.fail(&format!("{method} {path}: no answer ({e}); {ended}"))
            }
        }
    }

    fn ok(&mut self, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, answer) = self.call(method, path, body);
        if !(200..300).contains(&status) {
            self.fail(&format!("{method} {path}: {status} {answer}"));
        }
        answer
    }

    fn range(&self, from: usize, to: usize) -> (u64, u64) {
        (
            AREA + from as u64 * self.chunk,
            AREA + to as u64 * self.chunk,
        )
    }

    fn resume(&mut self) {
        if self.vm.paused {
            self.ok("PATCH", "/vm", Some(json!({"state": "Resumed"})));
            self.vm.paused = false;
        }
    }

    fn pause(&mut self) {
        if !self.vm.paused {
            self.ok("PATCH", "/vm", Some(json!({"state": "Paused"})));
            self.vm.paused = true;
        }
    }

    /// The guest writes chunks `[from, to)` with a new seed.
    fn write(&mut self, from: usize, to: usize) {
        self.resume();
        self.next_seed += 1;
        let seed = self.next_seed;
        let (start, end) = self.range(from, to);
        let answer = self.ok(
            "PUT",
            "/guest/command",
            Some(support::guest_command("write", start, end, seed)),
        );
        if answer["result"] != "ok" {
            self.fail(&format!("write {from}..{to}: {answer}"));
        }
        for chunk in &mut self.vm.model.area[from..to] {
            *chunk = seed;
        }
    }

    /// The guest verifies its whole area against the model (runs of chunks of one seed at a
    /// time).
    fn check(&mut self) {
        let was_paused = self.vm.paused;
        self.resume();
        let mut from = 0;
        while from < CHUNKS {
            let seed = self.vm.model.area[from];
            let to = (from..CHUNKS)
                .find(|&c| self.vm.model.area[c] != seed)
                .unwrap_or(CHUNKS);
            let (start, end) = self.range(from, to);
            let answer = self.ok(
                "PUT",
                "/guest/command",
                Some(support::guest_command("verify", start, end, seed)),
            );
            if answer["result"] != "ok" {
                let found = answer["found"].as_u64().unwrap_or(0);
                let address = answer["address"].as_u64().unwrap_or(0);
                // Which seed the page holds, if any the sequence wrote.
                let held = found ^ address;
                let whose = if held <= self.next_seed && held >= self.seed << 32 {
                    format!("it holds seed {held}, an older write")
                } else if found == 0 {
                    "it holds zeros: a page lost".to_owned()
                } else {
                    "it holds nothing the sequence wrote".to_owned()
                };
                self.fail(&format!(
                    "the VM ({}) does not hold what the model says: chunks {from}..{to} should \
                     hold seed {seed}: {answer} ({whose})",
                    self.vm.origin.0
                ));
            }
            from = to;
        }
        for extra in self.vm.model.extra.clone() {
            let answer = self.ok(
                "PUT",
                "/guest/command",
                Some(support::guest_command(
                    "verify",
                    extra.gpa,
                    extra.gpa + EXTRA_SIZE,
                    extra.seed,
                )),
            );
            if answer["result"] != "ok" {
                self.fail(&format!(
                    "the VM ({}) does not hold what the model says: the region at {:#x} should \
                     hold seed {}: {answer}",
                    self.vm.origin.0, extra.gpa, extra.seed
                ));
            }
        }
        if let Some(plugged) = self.vm.model.plugged.clone() {
            let area = self.ok("GET", "/hotplug/memory", None);
            if area["plugged_size_mib"] != plugged.len() as u64 * BLOCK_MIB {
                self.fail(&format!(
                    "the hotplug area has {} where the model says {} blocks of {BLOCK_MIB} MiB",
                    area,
                    plugged.len()
                ));
            }
            let base = area["guest_address"].as_u64().expect("the area's address");
            for (block, seed) in plugged.iter().enumerate() {
                let start = base + block as u64 * BLOCK_MIB * MIB;
                let command =
                    support::guest_command("verify", start, start + BLOCK_MIB * MIB, *seed);
                let answer = self.ok("PUT", "/guest/command", Some(command));
                if answer["result"] != "ok" {
                    self.fail(&format!(
                        "the VM ({}) does not hold what the model says: plugged block {block} \
                         should hold seed {seed}: {answer}",
                        self.vm.origin.0
                    ));
                }
            }
        }
        let regions = self.regions();
        let pieces = self.vm.model.plugged.as_ref().map_or(0, |p| {
            (p.len() as u64 * BLOCK_MIB).div_ceil(PIECE_MIB) as usize
        });
        let expected = 2 + self.vm.model.extra.len() + pieces;
        if regions.len() != expected {
            self.fail(&format!(
                "{} regions where the model says {expected}: {regions:?}",
                regions.len()
            ));
        }
        // Every snapshot, restore and migration keeps each region's page size (a file
        // restore maps transparent huge pages in 4 KiB pages).
        let initial = (AREA, self.vm.model.page);
        let extras = self.vm.model.extra.iter().map(|e| (e.gpa, e.page));
        for (gpa, page) in std::iter::once(initial).chain(extras) {
            if !regions.iter().any(|r| r.1 == gpa && r.3 == page.name()) {
                self.fail(&format!(
                    "the region at {gpa:#x} should be in {} pages: {regions:?}",
                    page.name()
                ));
            }
        }
        if was_paused {
            self.pause();
        }
    }

    /// `GET /memory`'s regions: (id, guest address, read-only, page size).
    fn regions(&mut self) -> Vec<(u64, u64, bool, String)> {
        let memory = self.ok("GET", "/memory", None);
        memory["regions"]
            .as_array()
            .expect("regions")
            .iter()
            .map(|r| {
                (
                    r["id"].as_u64().expect("an id"),
                    r["guest_address"].as_u64().expect("an address"),
                    r["read_only"].as_bool().expect("read_only"),
                    r["page_size"].as_str().expect("a page size").to_owned(),
                )
            })
            .collect()
    }

    /// The id of the region at `gpa`.
    fn region_at(&mut self, gpa: u64) -> u64 {
        match self.regions().into_iter().find(|r| r.1 == gpa) {
            Some((id, ..)) => id,
            None => self.fail(&format!("no region at {gpa:#x}, which the model has")),
        }
    }

    /// A free place for an added region, if any.
    fn free_place(&mut self) -> Option<u64> {
        let start = self.rng.below(EXTRA_PLACES as usize) as u64;
        (0..EXTRA_PLACES)
            .map(|i| EXTRA_BASE + (start + i) % EXTRA_PLACES * EXTRA_STRIDE)
            .find(|gpa| self.vm.model.extra.iter().all(|e| e.gpa != *gpa))
    }

    /// A change of the added regions, picked at random: add one (written whole with a new
    /// seed), remove one, move one, make one read-only or writable again, or write one (a
    /// write into a read-only region must be refused, 409, and change nothing).
    fn region_step(&mut self) {
        self.resume();
        let count = self.vm.model.extra.len();
        let pick = if count == 0 { 0 } else { self.rng.below(5) };
        let which = if count == 0 { 0 } else { self.rng.below(count) };
        match pick {
            0 => {
                let Some(gpa) = self.free_place() else {
                    return self.note("no free place for a region".to_owned());
                };
                let slot_size = [EXTRA_SIZE, EXTRA_SIZE / 8][self.rng.below(2)];
                let backing = ["anonymous", "memfd"][self.rng.below(2)];
                // One draw: 2 MiB pages as often as before THP joined, THP from 4 KiB's share.
                let page = match self.rng.next() % 100 {
                    0..40 => Page::Huge,
                    40..65 => Page::Thp,
                    _ => Page::Base,
                };
                let (huge, page_size) = (page == Page::Huge, page.name());
                let body = json!({"size": EXTRA_SIZE, "guest_address": gpa,
                                  "slot_size": slot_size, "backing": backing,
                                  "page_size": page_size});
                // Read before the request: no other process of this test takes pool pages
                // meanwhile (the sequences run one at a time).
                let pool = kvm_memslots::hugetlb_pages_available();
                let (status, answer) = self.call("PUT", "/memory/regions", Some(body));
                self.note(format!(
                    "add a {backing} region of {page_size} pages at {gpa:#x} in slots of \
                     {slot_size}: {status}"
                ));
                // 2 MiB pages take whole pages only, and the pool must hold them: each
                // refusal named, and nothing added.
                let refusal = match (huge, slot_size < EXTRA_SIZE, pool) {
                    (true, true, _) => Some((400, "is not a multiple of the page size (0x200000)")),
                    (true, false, 0) => Some((409, "free 2 MiB pages")),
                    _ => None,
                };
                if let Some((expected, why)) = refusal {
                    let message = answer["fault_message"].as_str().unwrap_or_default();
                    if status != expected || !message.contains(why) {
                        self.fail(&format!(
                            "a region of 2 MiB pages should be refused ({expected}, {why}): \
                             {status} {answer}"
                        ));
                    }
                    return;
                }
                if status != 201 {
                    self.fail(&format!("adding a region: {status} {answer}"));
                }
                self.vm.model.extra.push(Extra {
                    gpa,
                    seed: 0,
                    read_only: false,
                    page,
                    slot_size,
                });
                self.write_extra(count);
            }
            1 => {
                let gpa = self.vm.model.extra[which].gpa;
                let id = self.region_at(gpa);
                let (status, answer) = self.call("DELETE", &format!("/memory/regions/{id}"), None);
                self.note(format!("remove the region at {gpa:#x}: {status}"));
                if status != 204 {
                    self.fail(&format!("removing a region: {status} {answer}"));
                }
                self.vm.model.extra.remove(which);
            }
            2 => {
                let gpa = self.vm.model.extra[which].gpa;
                let Some(to) = self.free_place() else {
                    return self.note("no free place to move a region to".to_owned());
                };
                let id = self.region_at(gpa);
                let body = json!({"guest_address": to});
                let (status, answer) =
                    self.call("PATCH", &format!("/memory/regions/{id}"), Some(body));
                self.note(format!("move the region at {gpa:#x} to {to:#x}: {status}"));
                if status != 204 {
                    self.fail(&format!("moving a region: {status} {answer}"));
                }
                // The bytes move, not the pattern: what held `a ^ seed` at address `a` holds,
                // at `a`'s new address `b` (the same offset in a place aligned past the
                // region's size), `b ^ (seed ^ gpa ^ to)`.
                self.vm.model.extra[which].gpa = to;
                self.vm.model.extra[which].seed ^= gpa ^ to;
            }
            3 => {
                let extra = self.vm.model.extra[which].clone();
                let id = self.region_at(extra.gpa);
                let body = json!({"read_only": !extra.read_only});
                let (status, answer) =
                    self.call("PATCH", &format!("/memory/regions/{id}"), Some(body));
                self.note(format!(
                    "make the region at {:#x} read-only {}: {status}",
                    extra.gpa, !extra.read_only
                ));
                if status != 204 {
                    self.fail(&format!("a read-only change: {status} {answer}"));
                }
                self.vm.model.extra[which].read_only = !extra.read_only;
            }
            _ => self.write_extra(which),
        }
    }

    /// The hotplug area: configured the first time, and plugged or unplugged to a size picked
    /// at random (each newly plugged block written whole with a new seed; unplugged blocks
    /// forgotten: a replug gives fresh memory), the first time too, so that what follows
    /// meets plugged memory.
    fn hotplug_step(&mut self) {
        self.resume();
        if self.vm.model.plugged.is_none() {
            let page_size = self.vm.model.page.name();
            let body = json!({"total_size_mib": HOTPLUG_MIB, "block_size_mib": BLOCK_MIB,
                              "slot_size_mib": PIECE_MIB, "page_size": page_size});
            let (status, answer) = self.call("PUT", "/hotplug/memory", Some(body));
            self.note(format!(
                "configure a hotplug area of {HOTPLUG_MIB} MiB: {status}"
            ));
            if status != 204 {
                self.fail(&format!("configuring the hotplug area: {status} {answer}"));
            }
            self.vm.model.plugged = Some(Vec::new());
        }
        let plugged = self.vm.model.plugged.clone().unwrap_or_default();
        let blocks = self.rng.below((HOTPLUG_MIB / BLOCK_MIB) as usize + 1);
        let body = json!({"requested_size_mib": blocks as u64 * BLOCK_MIB});
        let (status, answer) = self.call("PATCH", "/hotplug/memory", Some(body));
        self.note(format!(
            "hotplug to {} MiB from {} MiB: {status}",
            blocks as u64 * BLOCK_MIB,
            plugged.len() as u64 * BLOCK_MIB
        ));
        if status != 204 {
            self.fail(&format!("plugging: {status} {answer}"));
        }
        let mut model: Vec<u64> = plugged.into_iter().take(blocks).collect();
        let base = self.ok("GET", "/hotplug/memory", None)["guest_address"]
            .as_u64()
            .expect("the area's address");
        while model.len() < blocks {
            self.next_seed += 1;
            let seed = self.next_seed;
            let start = base + model.len() as u64 * BLOCK_MIB * MIB;
            let command = support::guest_command("write", start, start + BLOCK_MIB * MIB, seed);
            let answer = self.ok("PUT", "/guest/command", Some(command));
            if answer["result"] != "ok" {
                self.fail(&format!("writing a plugged block: {answer}"));
            }
            model.push(seed);
        }
        self.vm.model.plugged = Some(model);
    }

    /// The guest writes added region `which` whole with a new seed; refused (409) if the model
    /// says it is read-only.
    fn write_extra(&mut self, which: usize) {
        self.next_seed += 1;
        let seed = self.next_seed;
        let extra = self.vm.model.extra[which].clone();
        let command = support::guest_command("write", extra.gpa, extra.gpa + EXTRA_SIZE, seed);
        let (status, answer) = self.call("PUT", "/guest/command", Some(command));
        self.note(format!(
            "write the region at {:#x} (read-only {}) seed {seed}: {status}",
            extra.gpa, extra.read_only
        ));
        match (extra.read_only, status) {
            (false, 200) if answer["result"] == "ok" => self.vm.model.extra[which].seed = seed,
            (true, 409) => {}
            _ => self.fail(&format!("a write into that region: {status} {answer}")),
        }
    }

    /// Cancels the live snapshot under way `after` its start, if given (a 409 means it had
    /// ended by itself).
    fn cancel_live(&mut self, after: Option<Duration>) {
        let Some(after) = after else { return };
        std::thread::sleep(after);
        let (status, answer) = self.call("PUT", "/snapshot/cancel", None);
        if !matches!(status, 204 | 409) {
            self.fail(&format!("cancel: {status} {answer}"));
        }
    }

    /// Waits for the live snapshot under way to end; its last `GET /snapshot`.
    fn live_outcome(&mut self) -> Value {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let info = self.ok("GET", "/snapshot", None);
            if !matches!(
                info["phase"].as_str(),
                Some("setup" | "pre_copy" | "stop_and_copy")
            ) {
                return info;
            }
            if Instant::now() > deadline {
                self.fail(&format!(
                    "the live snapshot did not end in 2 minutes: {info}"
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Records a snapshot the chain now ends with: a Full as it is, a Diff with its merged
    /// chain.
    fn record(&mut self, kind: &str, state: PathBuf, mem: PathBuf, name: &str) {
        let model = self.vm.model.clone();
        let (state, mem) = if kind == "Full" {
            self.vm.chain = Some(vec![(state.clone(), mem.clone())]);
            (state, mem)
        } else {
            let chain = self.vm.chain.as_mut().expect("a Diff follows a Full");
            chain.push((state.clone(), mem.clone()));
            let files: Vec<&Path> = chain
                .iter()
                .flat_map(|(s, m)| [s.as_path(), m.as_path()])
                .collect();
            let merged = self.dir.join(format!("{name}.merged"));
            let merge = Command::new(env!("CARGO_BIN_EXE_tinyvmm"))
                .arg("snapshot-merge")
                .arg("--out")
                .arg(&merged)
                .args(&files)
                .output()
                .expect("snapshot-merge runs");
            if !merge.status.success() {
                self.fail(&format!(
                    "snapshot-merge of the chain refused it: {}",
                    String::from_utf8_lossy(&merge.stderr).trim()
                ));
            }
            (state, merged)
        };
        let template = self.on_hugetlbfs(&mem);
        let size = std::fs::metadata(&mem).map_or(0, |m| m.len());
        self.saved.push(Saved {
            name: name.to_owned(),
            state,
            mem,
            model,
            ring: self.vm.ring,
            template,
            pages: size.div_ceil(2 * MIB),
        });
    }

    /// Where the memory file of snapshot `name` goes: the sequence's folder, or now and then
    /// the hugetlbfs mount. A Full goes there (a template for clones) only where the VM is on
    /// the 2 MiB grid and the pool holds the template and three clones' reservations (said
    /// loudly where it does not); a Diff goes there to be refused.
    fn memory_file(&mut self, kind: &str, name: &str) -> PathBuf {
        let file = format!("{name}.mem");
        let here = self.path(&file);
        let Some(there) = self.hugetlbfs.as_ref().map(|m| m.dir.join(&file)) else {
            return here;
        };
        if !self.places.chance(if kind == "Full" { 50 } else { 15 }) {
            return here;
        }
        if kind != "Full" {
            return there;
        }
        if !self.vm.model.on_2m_grid() {
            return here;
        }
        let pages = self.memory_pages();
        let free = kvm_memslots::hugetlb_pages_available();
        // The template's pages, and the reservation of each of the clones step's three, with
        // room to spare for the VMs' own 2 MiB pages.
        let needs = 4 * pages + 32;
        if free < needs {
            eprintln!(
                "SKIPPED lifecycle seed {} step {}: a template on hugetlbfs: the hugetlb pool \
                 has {free} free 2 MiB pages, a template of {pages} and three clones of it need \
                 {needs} with room to spare (resources/setup-host.sh reserves a pool); {name} \
                 goes to {}",
                self.seed,
                self.steps.len(),
                here.display()
            );
            return here;
        }
        there
    }

    /// Whether `file` is on the hugetlbfs mount.
    fn on_hugetlbfs(&self, file: &Path) -> bool {
        self.hugetlbfs
            .as_ref()
            .is_some_and(|m| file.starts_with(&m.dir))
    }

    /// The VM's memory (`GET /memory`'s regions) in 2 MiB pages.
    fn memory_pages(&mut self) -> u64 {
        let memory = self.ok("GET", "/memory", None);
        let bytes: u64 = memory["regions"]
            .as_array()
            .expect("regions")
            .iter()
            .map(|r| r["size"].as_u64().expect("a size"))
            .sum();
        bytes.div_ceil(2 * MIB)
    }

    /// A Diff whose memory file is on hugetlbfs (`mem`) must be refused (`refused`: a 400 at
    /// the request, paused or live), naming why in `answer` (its `fault_message`: hugetlbfs
    /// files have no holes to tell a Diff's pages by), and leave no file. The chain is as it was: the next Diff carries what
    /// this one would have.
    fn refused_on_hugetlbfs(&mut self, refused: bool, answer: &Value, state: &Path, mem: &Path) {
        let message = answer["fault_message"].as_str().unwrap_or_default();
        if !refused || !message.contains("Diff") || !message.contains("hugetlbfs") {
            self.fail(&format!(
                "a Diff on hugetlbfs should be refused naming hugetlbfs: {answer}"
            ));
        }
        if let Some(file) = [state, mem].into_iter().find(|f| f.exists()) {
            self.fail(&format!("a refused Diff left {}", file.display()));
        }
    }

    /// A paused Full or Diff. A Diff with no Full in this VM's chain must be refused (400).
    fn paused_snapshot(&mut self, kind: &str) {
        self.pause();
        let name = self.name(if kind == "Full" { "full" } else { "diff" });
        let (state, mem) = (
            self.path(&format!("{name}.state")),
            self.memory_file(kind, &name),
        );
        let body = json!({"snapshot_type": kind, "snapshot_path": state, "mem_file_path": mem});
        let (status, answer) = self.call("PUT", "/snapshot/create", Some(body));
        if kind == "Diff" && self.vm.chain.is_none() {
            self.note(format!(
                "paused Diff {name} with no Full before it: {status}"
            ));
            if status != 400 || state.exists() {
                self.fail(&format!("a Diff without a base: {status} {answer}"));
            }
            return;
        }
        if kind == "Diff" && self.on_hugetlbfs(&mem) {
            self.note(format!("paused Diff {name} on hugetlbfs: {status}"));
            return self.refused_on_hugetlbfs(status == 400, &answer, &state, &mem);
        }
        let place = if self.on_hugetlbfs(&mem) {
            " (a template on hugetlbfs)"
        } else {
            ""
        };
        self.note(format!("paused {kind} {name}{place}: {status}"));
        if status != 204 {
            self.fail(&format!("paused {kind}: {status} {answer}"));
        }
        self.record(kind, state, mem, &name);
    }

    /// A live Full or Diff, left to complete or cancelled (at once, or after a moment); a
    /// Diff now and then with the guest writing meanwhile ([`live_diff_of_a_writing_guest`]).
    ///
    /// [`live_diff_of_a_writing_guest`]: Self::live_diff_of_a_writing_guest
    fn live_snapshot(&mut self, kind: &str) {
        if kind == "Diff" && self.rng.chance(30) {
            return self.live_diff_of_a_writing_guest();
        }
        self.resume();
        let name = self.name(if kind == "Full" {
            "livefull"
        } else {
            "livediff"
        });
        let (state, mem) = (
            self.path(&format!("{name}.state")),
            self.memory_file(kind, &name),
        );
        let cancel = match self.rng.below(3) {
            0 => Some(Duration::ZERO),
            1 => Some(Duration::from_millis(self.rng.below(40) as u64)),
            _ => None,
        };
        let body = json!({"snapshot_type": kind, "snapshot_path": state, "mem_file_path": mem,
                          "live": true});
        let (status, answer) = self.call("PUT", "/snapshot/create", Some(body));
        if kind == "Diff" && self.vm.chain.is_none() {
            self.note(format!("live Diff {name} with no Full before it: {status}"));
            if status != 400 {
                self.fail(&format!("a live Diff without a base: {status} {answer}"));
            }
            return;
        }
        if kind == "Diff" && self.on_hugetlbfs(&mem) {
            // Refused at the request, as a paused Diff is, before any round runs.
            self.note(format!("live Diff {name} on hugetlbfs: {status}"));
            return self.refused_on_hugetlbfs(status == 400, &answer, &state, &mem);
        }
        if status != 204 {
            self.fail(&format!("live {kind}: {status} {answer}"));
        }
        self.cancel_live(cancel);
        let info = self.live_outcome();
        let phase = info["phase"].as_str().unwrap_or("").to_owned();
        let place = if self.on_hugetlbfs(&mem) {
            ", a template on hugetlbfs"
        } else {
            ""
        };
        self.note(format!(
            "live {kind} {name} (cancel {cancel:?}{place}): {phase} in round {}",
            info["round"]
        ));
        match phase.as_str() {
            "completed" => self.record(kind, state, mem, &name),
            "cancelled" => {
                if state.exists() || mem.exists() {
                    self.fail("a cancelled live snapshot left a file");
                }
                // A cancelled Full leaves no base; a cancelled Diff keeps its base, and the
                // next Diff carries what it took.
                if kind == "Full" {
                    self.vm.chain = None;
                }
            }
            _ => self.fail(&format!("live {kind}: {info}")),
        }
    }

    /// A live Diff while a write loop runs over some chunks, which never converges (a budget
    /// of 0) and ends `cancelled`: by a client's cancel at once or after a moment, or by its
    /// 1 s timeout. The rounds harvest the chain's reader while the loop dirties pages, and
    /// every page the Diff took must come back to the chain (the next Diff's merged chain is
    /// checked against the model when it is restored). The loop is then stopped, and its
    /// chunks hold its last pass.
    fn live_diff_of_a_writing_guest(&mut self) {
        self.resume();
        let from = self.rng.below(CHUNKS);
        let to = from + 1 + self.rng.below(CHUNKS - from);
        let (start, end) = self.range(from, to);
        let seed = self.next_seed + 1;
        let started = self.ok(
            "PUT",
            "/guest/command",
            Some(support::guest_command("write_loop", start, end, seed)),
        );
        if started["result"] != "started" {
            self.fail(&format!("write_loop {from}..{to}: {started}"));
        }
        let name = self.name("livediff");
        let (state, mem) = (
            self.path(&format!("{name}.state")),
            self.path(&format!("{name}.mem")),
        );
        let cancel = match self.rng.below(3) {
            0 => Some(Duration::ZERO),
            1 => Some(Duration::from_millis(self.rng.below(200) as u64)),
            _ => None,
        };
        let body = json!({"snapshot_type": "Diff", "snapshot_path": state, "mem_file_path": mem,
                          "live": true, "downtime_ms": 0, "timeout_s": 1,
                          "on_timeout": "cancel"});
        let (status, answer) = self.call("PUT", "/snapshot/create", Some(body));
        let outcome = if self.vm.chain.is_none() {
            if status != 400 {
                self.fail(&format!("a live Diff without a base: {status} {answer}"));
            }
            format!("{status} (no Full before it)")
        } else {
            if status != 204 {
                self.fail(&format!("live Diff of a writing guest: {status} {answer}"));
            }
            self.cancel_live(cancel);
            let info = self.live_outcome();
            if info["phase"] != "cancelled" {
                self.fail(&format!(
                    "a live Diff with a budget of 0 did not cancel: {info}"
                ));
            }
            if state.exists() || mem.exists() {
                self.fail("a cancelled live snapshot left a file");
            }
            format!("cancelled in round {}", info["round"])
        };
        self.stop_loop(from, to);
        let last = self.vm.model.area[from];
        self.note(format!(
            "live Diff {name} with a write loop over chunks {from}..{to} (cancel {cancel:?}): \
             {outcome}, loop's last pass {last}"
        ));
    }

    /// Restores a snapshot taken so far in a new process with a backend picked at random; it
    /// becomes the sequence's VM (the old one stops).
    fn restore(&mut self) {
        if self.saved.is_empty() {
            return self.paused_snapshot("Full");
        }
        let saved = self.pick_saved();
        let vm = self.restored(&saved);
        let old = std::mem::replace(&mut self.vm, vm);
        stop(old.process);
    }

    /// A snapshot taken so far, picked at random; half the time a template on hugetlbfs where
    /// the sequence has one (picked from the hugetlbfs variants' generator).
    fn pick_saved(&mut self) -> Saved {
        let picked = self.rng.below(self.saved.len());
        let templates: Vec<usize> = (0..self.saved.len())
            .filter(|&i| self.saved[i].template)
            .collect();
        if !templates.is_empty() && self.places.chance(50) {
            return self.saved[templates[self.places.below(templates.len())]].clone();
        }
        self.saved[picked].clone()
    }

    /// `saved` restored in a new process with a backend picked at random, waiting paused as a
    /// restored VM does.
    fn restored(&mut self, saved: &Saved) -> Vm {
        let backend = BACKENDS[self.rng.below(BACKENDS.len())];
        self.restored_by(saved, backend)
    }

    /// `saved` restored with `backend` as [`restored`](Self::restored) does; a template on
    /// hugetlbfs is cloned with the file backend half the time whatever `backend` says, each
    /// such clone mapping it privately in 2 MiB pages.
    fn restored_by(&mut self, saved: &Saved, backend: &'static str) -> Vm {
        let backend = if saved.template && self.places.chance(50) {
            "file"
        } else {
            backend
        };
        if backend == "file" && saved.template {
            // Each file clone reserves the template's pages in the pool as it maps them: one
            // the pool cannot cover is refused before it runs, naming the pool's free pages;
            // the sequence then restores by copy.
            let free = kvm_memslots::hugetlb_pages_available();
            match self.restore_with(saved, backend) {
                Ok(vm) => return vm,
                Err(e) if e.contains("hugetlb pool has") => {
                    self.note(format!(
                        "a file clone of template {} ({} pages) refused, the pool having {free} \
                         free pages: {e}",
                        saved.name, saved.pages
                    ));
                    return self.restored_with(saved, "copy");
                }
                Err(e) => self.fail(&format!("a file clone of a template on hugetlbfs: {e}")),
            }
        }
        let huge = |page: Page| page == Page::Huge;
        if backend == "file"
            && (huge(saved.model.page) || saved.model.extra.iter().any(|e| huge(e.page)))
        {
            // A file restore of 2 MiB pages is refused: the file is on no hugetlbfs (or the
            // region's file offset is off the 2 MiB grid, found first where a region before it
            // is not a multiple of 2 MiB: the test guest's area is not). It refuses, naming
            // why, before the guest runs; the sequence then restores by copy. A uffd restore
            // fills the 2 MiB pages whole, and the sequence's checks verify them.
            let why = ["hugetlbfs", "which is not on its pages"];
            let refused = self.restore_with(saved, backend);
            match refused {
                Err(e) if why.iter().any(|w| e.contains(w)) => {}
                Err(e) => self.fail(&format!("a {backend} restore of 2 MiB pages: {e}")),
                Ok(_) => self.fail(&format!(
                    "a {backend} restore of 2 MiB pages was not refused ({why:?})"
                )),
            }
            return self.restored_with(saved, "copy");
        }
        self.restored_with(saved, backend)
    }

    /// `saved` restored with `backend`, waiting paused.
    fn restored_with(&mut self, saved: &Saved, backend: &str) -> Vm {
        match self.restore_with(saved, backend) {
            Ok(vm) => vm,
            Err(e) => self.fail(&e),
        }
    }

    /// `saved` restored with `backend`; why not, with the end of its stderr, if it exits
    /// first.
    fn restore_with(&mut self, saved: &Saved, backend: &str) -> Result<Vm, String> {
        let name = self.name("restored");
        let mut args: Vec<String> = [
            "restore",
            "--snapshot",
            saved.state.to_str().expect("UTF-8"),
            "--mem-file",
            saved.mem.to_str().expect("UTF-8"),
            "--mem-backend",
            backend.trim_end_matches("-prefetch"),
        ]
        .map(String::from)
        .to_vec();
        if backend == "uffd-prefetch" {
            let list = self.path(&format!("{}.wset", saved.name));
            if list.exists() {
                args.extend(["--prefetch".to_owned(), list.display().to_string()]);
            } else {
                args.extend([
                    "--record-working-set".to_owned(),
                    list.display().to_string(),
                ]);
            }
        }
        let place = if saved.template {
            " (a template on hugetlbfs)"
        } else {
            ""
        };
        self.note(format!(
            "{name}: restore {}{place} with {backend}",
            saved.name
        ));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let process = spawn(&self.dir, &name, &args);
        process.try_wait_for_vm()?;
        let mut client = Client::connect(process.api()).expect("the restored VM's API");
        match client.call("GET", "/vm", None) {
            Ok((200, vm)) if vm["state"] == "Paused" => {}
            answer => self.fail(&format!("a restored VM waits, paused: {answer:?}")),
        }
        Ok(Vm {
            process,
            model: saved.model.restored_with(backend, saved.template),
            paused: true,
            ring: saved.ring,
            origin: Origin(format!(
                "{name}: {}{place} restored with {backend}",
                saved.name
            )),
            chain: None,
        })
    }

    /// Two clones of one snapshot side by side: each written with seeds of its own over the
    /// same chunks, and each then holding its own writes and the snapshot's pages alone (a
    /// private file mapping, of a template on hugetlbfs too, a userfaultfd loader or a copy
    /// shares nothing a clone wrote); a third, restored after they wrote, holds the snapshot's
    /// pages alone. One of the first two goes on as the sequence's VM.
    fn clones(&mut self) {
        if self.saved.is_empty() {
            return self.paused_snapshot("Full");
        }
        let saved = self.pick_saved();
        let from = self.rng.below(CHUNKS);
        let to = from + 1 + self.rng.below(CHUNKS - from);
        let first = self.restored(&saved);
        let old = std::mem::replace(&mut self.vm, first);
        stop(old.process);
        let mut second = self.restored(&saved);
        self.note(format!(
            "two clones of {}: each writes chunks {from}..{to}",
            saved.name
        ));
        for _ in 0..2 {
            self.write(from, to);
            std::mem::swap(&mut self.vm, &mut second);
        }
        for _ in 0..2 {
            self.check();
            std::mem::swap(&mut self.vm, &mut second);
        }
        // Its backend from the hugetlbfs variants' generator: the sequence's draws stay.
        let backend = BACKENDS[self.places.below(BACKENDS.len())];
        let third = self.restored_by(&saved, backend);
        let first = std::mem::replace(&mut self.vm, third);
        self.note(format!(
            "a third clone of {}: none of the two clones' writes",
            saved.name
        ));
        self.check();
        let third = std::mem::replace(&mut self.vm, first);
        stop(third.process);
        if self.rng.chance(50) {
            std::mem::swap(&mut self.vm, &mut second);
        }
        stop(second.process);
    }

    /// Ends the VM with `PUT /actions` Stop (exit 0) or SIGTERM (exit 130), now and then in
    /// the middle of a live snapshot that SIGTERM must cancel leaving no file; the sequence
    /// goes on from a restore of a snapshot taken so far.
    fn end_vm(&mut self) {
        if self.saved.is_empty() {
            return self.paused_snapshot("Full");
        }
        let how = self.rng.below(3);
        let mut left = Vec::new();
        let status = match how {
            0 => {
                let stop = json!({"action_type": "Stop"});
                self.ok("PUT", "/actions", Some(stop));
                exited(&mut self.vm.process)
            }
            1 => terminate(&mut self.vm.process),
            _ => {
                // A live Full that cannot converge (no downtime allowed) runs its rounds
                // until the signal ends it.
                self.resume();
                let name = self.name("sigterm");
                left = vec![
                    self.path(&format!("{name}.state")),
                    self.path(&format!("{name}.mem")),
                ];
                let body = json!({"snapshot_type": "Full", "snapshot_path": left[0],
                                  "mem_file_path": left[1], "live": true, "downtime_ms": 0,
                                  "timeout_s": 60});
                let (status, answer) = self.call("PUT", "/snapshot/create", Some(body));
                if status != 204 {
                    self.fail(&format!("a live Full: {status} {answer}"));
                }
                std::thread::sleep(Duration::from_millis(self.rng.below(50) as u64));
                terminate(&mut self.vm.process)
            }
        };
        let what = ["Stop", "SIGTERM", "SIGTERM in a live Full"][how];
        self.note(format!("end the VM: {what}: exit {status:?}"));
        let expected = if how == 0 { 0 } else { 130 };
        if status != Some(expected) {
            self.fail(&format!(
                "{what} ended the VMM with {status:?}, not {expected}"
            ));
        }
        if let Some(file) = left.iter().find(|f| f.exists()) {
            self.fail(&format!(
                "a live snapshot ended by SIGTERM left {}",
                file.display()
            ));
        }
        self.restore();
    }

    /// Migrates the VM to a new `tinyvmm receive`: completed (it becomes the sequence's VM) or
    /// cancelled (it runs on here).
    fn migrate(&mut self) {
        self.resume();
        let name = self.name("received");
        let listen = self.path(&format!("{name}.mig"));
        let tcp = self.rng.chance(25);
        let endpoint = if tcp {
            // A port nothing listens on now (the kernel's pick, freed again).
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            format!("tcp:127.0.0.1:{port}")
        } else {
            format!("unix:{}", listen.display())
        };
        // The destination logs with a ring or a bitmap, whichever the source does not always.
        let ring = self.rng.chance(40);
        let mut args = vec!["receive", "--listen", &endpoint];
        if ring {
            args.extend(["--dirty-ring", "4096"]);
        }
        let destination = spawn(&self.dir, &name, &args);
        destination.wait_listening();
        let local = !tcp && self.rng.chance(40);
        let cancel = self.rng.chance(30);
        // Now and then the guest writes in a loop all along: the rounds never converge (no
        // downtime is allowed), and at the 1 s timeout the migration either forces the pause
        // or gives up, as asked. The loop goes on wherever the VM then runs.
        let looping = self.rng.chance(30).then(|| {
            let from = self.rng.below(CHUNKS);
            (from, from + 1 + self.rng.below(CHUNKS - from))
        });
        let force = self.rng.chance(50);
        let body = match looping {
            Some((from, to)) => {
                let (start, end) = self.range(from, to);
                let command = support::guest_command("write_loop", start, end, self.next_seed + 1);
                let started = self.ok("PUT", "/guest/command", Some(command));
                if started["result"] != "started" {
                    self.fail(&format!("write_loop {from}..{to}: {started}"));
                }
                let on_timeout = if force { "force" } else { "cancel" };
                json!({"destination": endpoint, "local": local, "timeout_s": 1,
                       "downtime_ms": 0, "on_timeout": on_timeout})
            }
            None => json!({"destination": endpoint, "local": local, "timeout_s": 60}),
        };
        let (status, answer) = self.call("PUT", "/migrate", Some(body));
        if status != 204 {
            self.fail(&format!("PUT /migrate: {status} {answer}"));
        }
        if cancel {
            let (status, answer) = self.call("PUT", "/migrate/cancel", None);
            if !matches!(status, 204 | 409) {
                self.fail(&format!("cancel: {status} {answer}"));
            }
        }
        // The source ends (0) once the VM runs on the destination, or runs on after a cancel.
        let deadline = Instant::now() + Duration::from_secs(120);
        let phase = loop {
            if !self.vm.process.running() {
                break "completed".to_owned();
            }
            if let Ok((200, info)) = Client::connect(self.vm.process.api())
                .and_then(|mut c| c.call("GET", "/migrate", None))
            {
                let phase = info["phase"].as_str().unwrap_or("").to_owned();
                if matches!(phase.as_str(), "failed" | "cancelled" | "unconfirmed") {
                    if phase != "cancelled" {
                        self.fail(&format!("migration to {name}: {info}"));
                    }
                    break phase;
                }
            }
            if Instant::now() > deadline {
                self.fail("the migration did not end in 2 minutes");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        self.note(format!(
            "migrate to {name} over {endpoint} (local {local}, cancel {cancel}, destination \
             ring {ring}, write loop over {looping:?}, force at the timeout {force}): {phase}"
        ));
        if looping.is_some() && !cancel && phase != if force { "completed" } else { "cancelled" } {
            self.fail(&format!(
                "a migration that cannot converge ended {phase} with on_timeout force {force}"
            ));
        }
        if phase == "completed" {
            let status = exited(&mut self.vm.process);
            if status != Some(0) {
                self.fail(&format!("the source exited {status:?} after migrating"));
            }
            if let Err(e) = destination.try_wait_for_vm() {
                self.fail(&e);
            }
            let model = self.vm.model.clone();
            self.vm = Vm {
                process: destination,
                model,
                paused: false,
                ring,
                origin: Origin(format!("{name}: received from {}", self.vm.origin.0)),
                chain: None,
            };
        } else {
            stop(destination);
        }
        if let Some((from, to)) = looping {
            self.stop_loop(from, to);
        }
    }

    /// Stops vCPU 0's write loop over chunks `[from, to)`: they hold its last pass.
    fn stop_loop(&mut self, from: usize, to: usize) {
        let stop = json!({"op": "stop_loop", "vcpu": 0});
        let stopped = self.ok("PUT", "/guest/command", Some(stop));
        let Some(last) = stopped["last_seed"].as_u64() else {
            self.fail(&format!("stop_loop: {stopped}"))
        };
        for chunk in &mut self.vm.model.area[from..to] {
            *chunk = last;
        }
        self.next_seed = self.next_seed.max(last);
    }

    /// A client's harvest of the dirty log (turning logging on first): it takes no page from a
    /// snapshot chain's own reader.
    fn harvest(&mut self) {
        let (status, answer) = self.call("PATCH", "/dirty-log", Some(json!({"enabled": true})));
        if !matches!(status, 204 | 409) {
            self.fail(&format!("PATCH /dirty-log: {status} {answer}"));
        }
        if status == 204 {
            self.ok("POST", "/dirty-log/harvest", None);
        }
        self.note(format!("client harvest ({status})"));
    }

    /// One step, picked at random.
    fn step(&mut self) {
        match self.rng.below(108) {
            0..=19 => {
                let from = self.rng.below(CHUNKS);
                let to = from + 1 + self.rng.below(CHUNKS - from);
                self.write(from, to);
                self.note(format!("write chunks {from}..{to} seed {}", self.next_seed));
            }
            20..=31 => {
                if self.vm.paused {
                    self.resume();
                    self.note("resume".to_owned());
                } else {
                    self.pause();
                    self.note("pause".to_owned());
                }
            }
            32..=43 => self.paused_snapshot("Full"),
            44..=53 => self.paused_snapshot("Diff"),
            54..=61 => self.live_snapshot("Full"),
            62..=71 => self.live_snapshot("Diff"),
            72..=81 => self.restore(),
            82..=89 => self.migrate(),
            90..=93 => self.region_step(),
            94..=98 => self.hotplug_step(),
            99 => self.harvest(),
            100..=103 => self.end_vm(),
            _ => self.clones(),
        }
        self.check();
    }

    fn finish(self) {
        stop(self.vm.process);
        // The mount first: its templates' pages go back to the pool.
        drop(self.hugetlbfs);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs sequence `seed` for `steps` steps.
fn run(seed: u64, steps: usize) {
    let mut sequence = Sequence::start(seed);
    sequence.check();
    for _ in 0..steps {
        sequence.step();
    }
    sequence.finish();
}

#[test]
fn kvm_lifecycle_sequences_keep_every_page() {
    if !kvm_test_support::require_kvm("tinyvmm::kvm_lifecycle_sequences_keep_every_page") {
        return;
    }
    for seed in CI_SEEDS {
        run(seed, CI_STEPS);
    }
}

/// Replays one sequence: `LIFECYCLE_SEED` and `LIFECYCLE_STEPS`.
#[test]
#[ignore = "run by hand to replay a failure"]
fn replay() {
    let number = |name: &str| -> u64 {
        std::env::var(name)
            .unwrap_or_else(|_| panic!("set {name}"))
            .parse()
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    run(number("LIFECYCLE_SEED"), number("LIFECYCLE_STEPS") as usize);
}

/// Fresh seeds for `LIFECYCLE_SOAK_SECS` seconds (from `LIFECYCLE_SOAK_FIRST`, default 1000),
/// 40 steps each; prints how many sequences and steps ran.
#[test]
#[ignore = "a soak, run by hand"]
fn soak() {
    let secs: u64 = std::env::var("LIFECYCLE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let first: u64 = std::env::var("LIFECYCLE_SOAK_FIRST")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let started = Instant::now();
    let mut seed = first;
    while started.elapsed() < Duration::from_secs(secs) {
        run(seed, 40);
        seed += 1;
    }
    eprintln!(
        "lifecycle soak: seeds {first}..{seed} ({} sequences of 40 steps) in {:.0} s, no failure",
        seed - first,
        started.elapsed().as_secs_f64()
    );
}
