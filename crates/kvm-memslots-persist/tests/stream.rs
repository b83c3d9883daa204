//! The memory stream between two managers, as two VMM processes would use it over a Unix
//! socket: a first round of every page with data, rounds of harvested pages while the "guest"
//! keeps writing, state, and Done; and every kind of bad stream refused with its reason.

use std::io::{Cursor, Read};
use std::os::unix::net::UnixStream;
use std::thread;

use kvm_memslots::testing::FakeKvm;
use kvm_memslots::{Backing, MemoryManager, PageSize, RegionSpec, SlotFlags, Target, PAGE_SIZE};
use kvm_memslots_persist::stream::{
    apply_pages, check_layout, page_hash, read_answer, send_answer, shared_files, MemoryDigest,
    Record, RegionDigest, StreamError, StreamReader, StreamWriter, MAX_HANDOVER, MAX_RUN,
};
use kvm_memslots_persist::MemoryLayout;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

const MIB: u64 = 1 << 20;

/// Two logging regions (one in 16 KiB slots), and a read-only one.
fn source() -> MemoryManager<FakeKvm> {
    let m = MemoryManager::new(FakeKvm::new(512, true));
    let logging = SlotFlags {
        log_dirty: true,
        read_only: false,
    };
    m.add_region(
        RegionSpec::new(GuestAddress(MIB), 3 * MIB)
            .with_slot_size(16 << 10)
            .with_flags(logging),
    )
    .expect("the fake takes it");
    m.add_region(RegionSpec::new(GuestAddress(8 * MIB), MIB).with_flags(logging))
        .expect("the fake takes it");
    m.add_region(
        RegionSpec::new(GuestAddress(16 * MIB), 256 << 10).with_flags(SlotFlags {
            read_only: true,
            log_dirty: false,
        }),
    )
    .expect("the fake takes it");
    m
}

/// Writes `value` at `gpa` as the guest would: through the mapping, and in KVM's log.
fn guest_write(m: &MemoryManager<FakeKvm>, gpa: u64, value: u64) {
    m.handle()
        .memory()
        .write_obj(value, GuestAddress(gpa))
        .expect("guest memory");
    m.kvm().guest_write(gpa);
}

fn read(m: &MemoryManager<FakeKvm>, gpa: u64) -> u64 {
    m.handle()
        .memory()
        .read_obj(GuestAddress(gpa))
        .expect("guest memory")
}

/// What a receiver ends with: the new VM's memory, the state, and each round's page count.
type Received = (MemoryManager<FakeKvm>, Vec<u8>, Vec<u64>);

/// Receives a whole stream into a manager built from its layout, and checks its memory
/// against the sender's digest.
fn receive(input: impl Read) -> Result<Received, StreamError> {
    receive_with(input, |_| {})
}

/// [`receive`], with `landed` run on the memory once the last page landed, before the check.
fn receive_with(
    input: impl Read,
    landed: impl FnOnce(&MemoryManager<FakeKvm>),
) -> Result<Received, StreamError> {
    let mut reader = StreamReader::new(input);
    let Some(Record::Hello { layout, .. }) = reader.next_record()? else {
        panic!("Hello comes first");
    };
    let m = MemoryManager::new(FakeKvm::new(512, true));
    layout.build(&m).expect("the fake takes the layout");
    check_layout(&layout, &MemoryLayout::of(&m))?;
    let (mut state, mut rounds) = (Vec::new(), Vec::new());
    while let Some(record) = reader.next_record()? {
        match record {
            Record::Pages { offset, data } => apply_pages(&m, &layout, offset, &data)?,
            Record::State(s) => state = s,
            Record::RoundEnd { pages, .. } => rounds.push(pages),
            Record::Done | Record::Digest(_) => {}
            Record::Hello { .. } | Record::Handover(_) => unreachable!("refused by the reader"),
        }
    }
    landed(&m);
    reader.verify(&m)?;
    Ok((m, state, rounds))
}

#[test]
fn pages_rounds_and_state_arrive_over_a_socket_and_every_page_matches() {
    let src = source();
    // Data in every region, including across slot boundaries, and a hole left untouched.
    for (i, gpa) in [
        MIB,
        MIB + (16 << 10) - 8,
        2 * MIB + 0x5000,
        8 * MIB + 0xf_f000,
    ]
    .into_iter()
    .enumerate()
    {
        guest_write(&src, gpa, 0x1111 * (i as u64 + 1));
    }
    src.handle()
        .memory()
        .write_obj(0xabcdu64, GuestAddress(16 * MIB + 0x1000))
        .unwrap();
    src.harvest_dirty(Target::All).unwrap();
    let layout = MemoryLayout::of(&src);

    let (tx, rx) = UnixStream::pair().unwrap();
    let receiver = thread::spawn(move || receive(rx));
    let mut writer = StreamWriter::new(tx);
    writer.hello(&layout).unwrap();
    let first = writer.send_all(&src).unwrap();
    writer.end_round().unwrap();
    // The guest keeps writing: round 2 sends exactly what it wrote since the first harvest.
    guest_write(&src, MIB + 0x3000, 0x2222);
    guest_write(&src, 8 * MIB, 0x3333);
    let dirty = src.harvest_dirty(Target::All).unwrap();
    let second = writer.send_dirty(&src, &dirty).unwrap();
    writer.end_round().unwrap();
    assert_eq!((second.bytes, second.records), (2 * PAGE_SIZE, 2));
    writer.state(b"vcpu state").unwrap();
    writer.done().unwrap();
    drop(writer);

    let (dst, state, rounds) = receiver.join().unwrap().unwrap();
    assert_eq!(state, b"vcpu state");
    assert_eq!(rounds, vec![first.bytes / PAGE_SIZE, 2]);
    // Only pages with data were sent in round 1: far less than the 4.25 MiB of memory.
    assert!(first.bytes < MIB, "{first:?}");
    for gpa in [
        MIB,
        MIB + (16 << 10) - 8,
        2 * MIB + 0x5000,
        8 * MIB + 0xf_f000,
        MIB + 0x3000,
        8 * MIB,
        16 * MIB + 0x1000,
        3 * MIB, // never written: zero on both sides
    ] {
        assert_eq!(read(&dst, gpa), read(&src, gpa), "guest {gpa:#x}");
    }
    assert_eq!(read(&dst, 8 * MIB), 0x3333);
}

/// A stream with one Hello, one full round and Done, as bytes.
fn sample_stream() -> Vec<u8> {
    let src = source();
    guest_write(&src, MIB, 7);
    let mut writer = StreamWriter::new(Vec::new());
    writer
        .hello(&MemoryLayout::of(&src))
        .expect("a Vec takes it");
    writer.send_all(&src).expect("a Vec takes it");
    writer.end_round().expect("a Vec takes it");
    writer.done().expect("a Vec takes it");
    writer.get_ref().clone()
}

fn read_all(bytes: &[u8]) -> Result<(), StreamError> {
    let mut reader = StreamReader::new(Cursor::new(bytes));
    while reader.next_record()?.is_some() {}
    Ok(())
}

#[test]
fn a_flipped_byte_anywhere_is_refused_as_corrupted() {
    let stream = sample_stream();
    read_all(&stream).unwrap();
    // In the Hello's layout, in a page's data, in a header's length.
    for at in [40, stream.len() / 2, stream.len() - 20] {
        let mut bad = stream.clone();
        bad[at] ^= 0x10;
        let err = read_all(&bad).unwrap_err().to_string();
        assert!(
            err.contains("corrupted") || err.contains("ended early"),
            "byte {at}: {err}"
        );
    }
}

#[test]
fn a_stream_cut_short_is_refused_as_truncated() {
    let stream = sample_stream();
    for len in [0, 5, 100, stream.len() - 1] {
        let err = read_all(&stream[..len]).unwrap_err();
        assert!(matches!(err, StreamError::Truncated(_)), "{len}: {err}");
        assert!(
            err.to_string().starts_with("the stream ended early"),
            "{err}"
        );
    }
}

#[test]
fn another_version_or_kind_of_stream_is_refused_with_the_reason() {
    let src = source();
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&MemoryLayout::of(&src)).unwrap();
    let mut stream = writer.get_ref().clone();
    // The version sits after the 12-byte header and the 8-byte magic; fix the checksum up as
    // a sender of version 9 would have computed it.
    stream[20] = 9;
    let len = u32::from_le_bytes(stream[4..8].try_into().unwrap());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[stream[0]]);
    crc.update(&len.to_le_bytes());
    crc.update(&stream[12..]);
    stream[8..12].copy_from_slice(&crc.finalize().to_le_bytes());
    let err = read_all(&stream).unwrap_err().to_string();
    assert_eq!(
        err,
        "invalid stream: stream version 9; this build reads version 3"
    );
    let err = read_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap_err();
    assert!(
        err.to_string().contains("corrupted") || err.to_string().contains("over the limit"),
        "{err}"
    );
}

#[test]
fn records_out_of_order_are_refused() {
    // Pages before Hello.
    let src = source();
    let mut writer = StreamWriter::new(Vec::new());
    assert!(writer.send_all(&src).is_err(), "the writer refuses it too");
    let stream = sample_stream();
    let hello_len = 12 + u32::from_le_bytes(stream[4..8].try_into().unwrap()) as usize;
    let err = read_all(&stream[hello_len..]).unwrap_err().to_string();
    assert!(err.contains("before Hello"), "{err}");
    // A second Hello.
    let mut twice = stream[..hello_len].to_vec();
    twice.extend_from_slice(&stream);
    let err = read_all(&twice).unwrap_err().to_string();
    assert_eq!(err, "invalid stream: a second Hello");
}

#[test]
fn a_round_whose_page_count_does_not_match_is_refused() {
    let src = source();
    guest_write(&src, MIB, 7);
    guest_write(&src, 2 * MIB, 7);
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&MemoryLayout::of(&src)).unwrap();
    writer.send_all(&src).unwrap();
    writer.end_round().unwrap();
    let stream = writer.get_ref().clone();
    // Drop the first Pages record (a sender that lost one): the round's count gives it away.
    let hello_len = 12 + u32::from_le_bytes(stream[4..8].try_into().unwrap()) as usize;
    let pages_len =
        12 + u32::from_le_bytes(stream[hello_len + 4..hello_len + 8].try_into().unwrap()) as usize;
    let mut lost = stream[..hello_len].to_vec();
    lost.extend_from_slice(&stream[hello_len + pages_len..]);
    let err = read_all(&lost).unwrap_err().to_string();
    assert!(err.contains("round 1 ends with"), "{err}");
}

#[test]
fn a_different_layout_is_refused_before_any_page() {
    let src = source();
    let other = MemoryManager::new(FakeKvm::new(512, true));
    other
        .add_region(RegionSpec::new(GuestAddress(MIB), 3 * MIB))
        .unwrap();
    let err = check_layout(&MemoryLayout::of(&src), &MemoryLayout::of(&other)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the memory layouts differ: the sender has 3 regions, this VM 1"
    );
    other
        .add_region(RegionSpec::new(GuestAddress(8 * MIB), MIB))
        .unwrap();
    other
        .add_region(RegionSpec::new(GuestAddress(16 * MIB), 256 << 10))
        .unwrap();
    let err = check_layout(&MemoryLayout::of(&src), &MemoryLayout::of(&other)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the memory layouts differ: the sender's region at guest 0x100000 (0x300000 bytes, \
         slots of 0x4000) is here a region at guest 0x100000 (0x300000 bytes, slots of 0x300000)"
    );
}

#[test]
fn long_runs_are_cut_into_records_of_at_most_max_run() {
    let src = source();
    // 3 MiB of data in one region: one run, three records.
    src.handle()
        .memory()
        .write_slice(&vec![0x5a; 3 * MIB as usize], GuestAddress(MIB))
        .unwrap();
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&MemoryLayout::of(&src)).unwrap();
    let stats = writer.send_all(&src).unwrap();
    assert_eq!(stats.bytes, 3 * MIB);
    assert_eq!(stats.records, 3 * MIB / MAX_RUN);
}

#[test]
fn answers_go_back_and_a_bad_one_is_refused() {
    let mut wire = Vec::new();
    send_answer(&mut wire, Ok(())).unwrap();
    send_answer(&mut wire, Err("no room for 9 GiB")).unwrap();
    let mut input = Cursor::new(wire.clone());
    assert_eq!(read_answer(&mut input).unwrap(), Ok(()));
    assert_eq!(
        read_answer(&mut input).unwrap(),
        Err("no room for 9 GiB".to_string())
    );
    // A flipped byte, or a record that is not an answer.
    let mut flipped = wire.clone();
    flipped[12] ^= 1;
    assert!(read_answer(&mut Cursor::new(flipped))
        .unwrap_err()
        .to_string()
        .contains("corrupted"));
    let err = read_answer(&mut Cursor::new(sample_stream())).unwrap_err();
    assert!(
        err.to_string().contains("expected the receiver's answer"),
        "{err}"
    );
}

/// A source with a memfd region between two anonymous ones.
fn shared_source() -> MemoryManager<FakeKvm> {
    let m = MemoryManager::new(FakeKvm::new(512, true));
    m.add_region(RegionSpec::new(GuestAddress(MIB), MIB))
        .expect("the fake takes it");
    m.add_region(RegionSpec::new(GuestAddress(4 * MIB), 2 * MIB).with_backing(Backing::Memfd))
        .expect("the fake takes it");
    m.add_region(RegionSpec::new(GuestAddress(8 * MIB), MIB))
        .expect("the fake takes it");
    m
}

#[test]
fn a_handover_shares_the_memfd_and_only_the_rest_is_copied() {
    let src = shared_source();
    guest_write(&src, MIB, 1);
    guest_write(&src, 4 * MIB + 0x3000, 2);
    guest_write(&src, 8 * MIB, 3);
    let layout = MemoryLayout::of(&src);
    let files = shared_files(&src, &layout).unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].0, 1, "the middle region is the shared one");
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello_handing_over(&layout).unwrap();
    writer
        .handover(&[(files[0].0, files[0].1.start())])
        .unwrap();
    let sent = writer.send_all(&src).unwrap();
    assert_eq!(
        sent.bytes,
        2 * PAGE_SIZE,
        "the two anonymous pages, not the memfd's"
    );
    writer.end_round().unwrap();
    writer.done().unwrap();

    let mut reader = StreamReader::new(Cursor::new(writer.get_ref().clone()));
    let Some(Record::Hello { layout, hands_over }) = reader.next_record().unwrap() else {
        panic!("Hello first");
    };
    assert!(hands_over);
    let Some(Record::Handover(regions)) = reader.next_record().unwrap() else {
        panic!("the Handover next");
    };
    assert_eq!(regions, vec![(1, files[0].1.start())]);
    // The receiver maps the same memfd (here: the same process's file).
    let handed = [(1usize, files[0].1.clone())].into_iter().collect();
    let dst = MemoryManager::new(FakeKvm::new(512, true));
    layout.build_handed_over(&dst, &handed).unwrap();
    while let Some(record) = reader.next_record().unwrap() {
        if let Record::Pages { offset, data } = record {
            apply_pages(&dst, &layout, offset, &data).unwrap();
        }
    }
    assert_eq!(read(&dst, MIB), 1);
    assert_eq!(read(&dst, 8 * MIB), 3);
    assert_eq!(read(&dst, 4 * MIB + 0x3000), 2, "shared, not copied");
    // The shared region is not in the digest (it is the same memory); the rest is checked.
    let digest = reader.digest().expect("the Digest came").clone();
    assert_eq!(digest.regions[1], RegionDigest::default());
    assert_eq!((digest.regions[0].pages, digest.regions[2].pages), (1, 1));
    assert_eq!(reader.verify(&dst).unwrap(), digest);
    // One memory: a write on one side is there on the other.
    guest_write(&src, 4 * MIB + 0x5000, 9);
    assert_eq!(read(&dst, 4 * MIB + 0x5000), 9);
}

#[test]
fn handovers_out_of_place_are_refused() {
    let src = shared_source();
    let layout = MemoryLayout::of(&src);
    // A Hello that announced none.
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&layout).unwrap();
    writer.handover(&[(1, 0)]).unwrap();
    let err = read_all(writer.get_ref()).unwrap_err().to_string();
    assert!(err.contains("announced none"), "{err}");
    // Pages before every shared region was handed over.
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello_handing_over(&layout).unwrap();
    writer.send_all(&src).unwrap();
    writer.end_round().unwrap();
    let err = read_all(writer.get_ref()).unwrap_err().to_string();
    assert!(err.contains("before every shared region"), "{err}");
    // An anonymous region, or one twice: the writer refuses the first, the reader the second.
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello_handing_over(&layout).unwrap();
    assert!(writer.handover(&[(0, 0)]).is_err());
    assert!(writer.handover(&[]).is_err());
    assert!(writer.handover(&vec![(1, 0); MAX_HANDOVER + 1]).is_err());
    writer.handover(&[(1, 0), (1, 0)]).unwrap();
    let err = read_all(writer.get_ref()).unwrap_err().to_string();
    assert!(
        err.contains("not a shared region still to hand over"),
        "{err}"
    );
}

/// A record framed as any sender would (kind, length, CRC-32 over kind, length and payload):
/// its checksum is valid whatever it holds.
fn raw_record(kind: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[kind]);
    crc.update(&len.to_le_bytes());
    crc.update(payload);
    let mut record = vec![kind, 0, 0, 0];
    record.extend_from_slice(&len.to_le_bytes());
    record.extend_from_slice(&crc.finalize().to_le_bytes());
    record.extend_from_slice(payload);
    record
}

/// A Pages record of `len` zero bytes at memory-file `offset`, with a valid checksum.
fn raw_pages(offset: u64, len: usize) -> Vec<u8> {
    let mut payload = offset.to_le_bytes().to_vec();
    payload.resize(8 + len, 0);
    raw_record(2, &payload)
}

#[test]
fn records_with_valid_checksums_that_do_not_fit_the_layout_are_refused() {
    let src = source();
    let layout = MemoryLayout::of(&src);
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&layout).unwrap();
    let hello = writer.get_ref().clone();
    let last = layout.regions.last().unwrap();
    let end = last.file_offset + last.size;
    let page = PAGE_SIZE as usize;
    // The first region is 3 MiB at file offset 0, the second follows it.
    for (offset, len, what) in [
        (end, page, "past the layout's end"),
        (end - PAGE_SIZE, 2 * page, "running past the layout's end"),
        (u64::MAX - PAGE_SIZE + 1, page, "wrapping around"),
        (0x800, page, "not page-aligned"),
        (0, 100, "not whole pages"),
        (0, 0, "no page at all"),
        (3 * MIB - PAGE_SIZE, 2 * page, "across two regions"),
    ] {
        let mut stream = hello.clone();
        stream.extend(raw_pages(offset, len));
        let err = read_all(&stream).unwrap_err().to_string();
        assert!(
            err.contains("not whole pages inside one region"),
            "{what}: {err}"
        );
    }
    // Page counts and round numbers that do not add up, and a RoundEnd of the wrong size.
    let round_end = |round: u32, pages: u64| {
        let mut payload = round.to_le_bytes().to_vec();
        payload.extend_from_slice(&pages.to_le_bytes());
        raw_record(4, &payload)
    };
    for (records, expected) in [
        (
            vec![raw_pages(0, page), round_end(1, 2)],
            "round 1 ends with 2 pages",
        ),
        (vec![round_end(2, 0)], "this is round 1"),
        (vec![raw_record(4, &[0; 11])], "too short"),
        (vec![raw_record(9, &[])], "unknown record kind 9"),
    ] {
        let mut stream = hello.clone();
        records.into_iter().for_each(|r| stream.extend(r));
        let err = read_all(&stream).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
    // A Hello too short for its flags, with a valid checksum.
    let mut short = b"KVMSMIG\0".to_vec();
    short.extend_from_slice(&3u32.to_le_bytes());
    let err = read_all(&raw_record(1, &short)).unwrap_err().to_string();
    assert!(err.contains("Hello record is too short"), "{err}");
}

#[test]
fn state_comes_once_between_rounds_and_only_done_follows_it() {
    let src = source();
    guest_write(&src, MIB, 7);
    let layout = MemoryLayout::of(&src);
    let stream = |steps: &dyn Fn(&mut StreamWriter<Vec<u8>>)| {
        let mut writer = StreamWriter::new(Vec::new());
        writer.hello(&layout).unwrap();
        steps(&mut writer);
        read_all(writer.get_ref()).map_err(|e| e.to_string())
    };
    // Pages after the last RoundEnd were never counted: State or Done there is refused.
    let err = stream(&|w| {
        w.send_all(&src).unwrap();
        w.state(b"state").unwrap();
    })
    .unwrap_err();
    assert!(err.contains("State record inside round 1"), "{err}");
    let err = stream(&|w| {
        w.send_all(&src).unwrap();
        w.done().unwrap();
    })
    .unwrap_err();
    // (Done sends the Digest record first.)
    assert!(err.contains("Digest record inside round 1"), "{err}");
    // A second State, or pages after it.
    let err = stream(&|w| {
        w.end_round().unwrap();
        w.state(b"one").unwrap();
        w.state(b"two").unwrap();
    })
    .unwrap_err();
    assert!(err.contains("after the State record"), "{err}");
    let err = stream(&|w| {
        w.end_round().unwrap();
        w.state(b"state").unwrap();
        w.send_all(&src).unwrap();
    })
    .unwrap_err();
    assert!(err.contains("after the State record"), "{err}");
    // In order it reads to the end.
    stream(&|w| {
        w.send_all(&src).unwrap();
        w.end_round().unwrap();
        w.state(b"state").unwrap();
        w.done().unwrap();
    })
    .unwrap();
}

#[test]
fn a_handover_at_an_offset_no_file_can_hold_is_refused() {
    let src = shared_source();
    let layout = MemoryLayout::of(&src);
    for offset in [0x800, u64::MAX - PAGE_SIZE + 1] {
        let mut writer = StreamWriter::new(Vec::new());
        writer.hello_handing_over(&layout).unwrap();
        writer.handover(&[(1, offset)]).unwrap();
        let err = read_all(writer.get_ref()).unwrap_err().to_string();
        assert!(err.contains("not page-aligned or leaves no room"), "{err}");
    }
}

/// Two rounds from [`source`]: a page written in round 1 and again in round 2, a page that
/// holds data in round 1 and zeros in round 2, data in every region; the stream's bytes and
/// the source's memory as the destination should hold it.
fn two_round_stream() -> (Vec<u8>, MemoryManager<FakeKvm>) {
    let src = source();
    for gpa in [MIB, MIB + 0x7000, 2 * MIB + 0x5000, 8 * MIB + 0xf_f000] {
        guest_write(&src, gpa, gpa ^ 0x5a5a);
    }
    src.handle()
        .memory()
        .write_obj(0xabcdu64, GuestAddress(16 * MIB + 0x1000))
        .expect("the fake and a Vec take it");
    src.harvest_dirty(Target::All)
        .expect("the fake and a Vec take it");
    let mut writer = StreamWriter::new(Vec::new());
    writer
        .hello(&MemoryLayout::of(&src))
        .expect("the fake and a Vec take it");
    writer.send_all(&src).expect("the fake and a Vec take it");
    writer.end_round().expect("the fake and a Vec take it");
    guest_write(&src, MIB, 0x2222);
    guest_write(&src, MIB + 0x7000, 0);
    let dirty = src
        .harvest_dirty(Target::All)
        .expect("the fake and a Vec take it");
    writer
        .send_dirty(&src, &dirty)
        .expect("the fake and a Vec take it");
    writer.end_round().expect("the fake and a Vec take it");
    // What was sent, last copies only, is the source's memory now.
    let sent = writer.digest();
    let here = MemoryDigest::of_memory(&src, &MemoryLayout::of(&src), &[])
        .expect("the fake and a Vec take it");
    assert_eq!(sent, here, "a page sent again replaces what it contributed");
    assert_eq!(
        sent.regions[0].pages, 2,
        "the page now zeros contributes nothing"
    );
    writer.state(b"state").expect("the fake and a Vec take it");
    writer.done().expect("the fake and a Vec take it");
    (writer.get_ref().clone(), src)
}

#[test]
fn the_memory_that_arrived_is_checked_against_the_senders_digest() {
    let (stream, src) = two_round_stream();
    let (dst, ..) = receive(stream.as_slice()).expect("the memory is what was sent");
    assert_eq!(read(&dst, MIB), 0x2222);
    assert_eq!(
        MemoryDigest::of_memory(&dst, &MemoryLayout::of(&dst), &[]).unwrap(),
        MemoryDigest::of_memory(&src, &MemoryLayout::of(&src), &[]).unwrap()
    );
    // A page's contribution: its address and its bytes; zeros contribute nothing.
    let page = [7u8; PAGE_SIZE as usize];
    assert_ne!(page_hash(0, &page), page_hash(PAGE_SIZE, &page));
    assert_eq!(page_hash(PAGE_SIZE, &[0; PAGE_SIZE as usize]), 0);
}

#[test]
fn a_page_changed_or_dropped_after_it_landed_is_refused_naming_its_region() {
    // One byte changed in a page of the second region.
    let (stream, _) = two_round_stream();
    let err = receive_with(stream.as_slice(), |m| {
        m.handle()
            .memory()
            .write_obj(1u8, GuestAddress(8 * MIB + 0xf_f010))
            .unwrap();
    })
    .unwrap_err();
    assert!(matches!(err, StreamError::Mismatch(_)), "{err}");
    let err = err.to_string();
    assert!(
        err.starts_with(
            "the memory here is not what the source sent: the region at guest 0x800000 \
             (0x100000 bytes) holds 1 pages of data here"
        ),
        "{err}"
    );
    assert!(
        err.contains("the sender sent 1") && err.contains("1 of 3 regions differ"),
        "{err}"
    );
    // A page dropped (zeros where data was sent), in the first region.
    let err = receive_with(stream.as_slice(), |m| {
        m.handle()
            .memory()
            .write_slice(&[0; PAGE_SIZE as usize], GuestAddress(2 * MIB + 0x5000))
            .unwrap();
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("the region at guest 0x100000 (0x300000 bytes) holds 1 pages of data here")
            && err.contains("the sender sent 2"),
        "{err}"
    );
    // A page of data where the sender sent none, in the read-only region.
    let err = receive_with(stream.as_slice(), |m| {
        m.handle()
            .memory()
            .write_obj(3u8, GuestAddress(16 * MIB + 0x3_0000))
            .unwrap();
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("region at guest 0x1000000"), "{err}");
}

/// `stream` with the first data byte of its `from_end`th Pages record from the end changed
/// and the checksum made valid again: a sender (or a transport) that got a page wrong before
/// it framed it.
fn with_wrong_page(stream: &[u8], from_end: usize) -> Vec<u8> {
    let mut out = stream.to_vec();
    let (mut at, mut pages) = (0, Vec::new());
    while at < out.len() {
        let len =
            u32::from_le_bytes(out[at + 4..at + 8].try_into().expect("a record header")) as usize;
        if out[at] == 2 {
            pages.push((at, len));
        }
        at += 12 + len;
    }
    let (at, len) = pages[pages.len() - 1 - from_end];
    out[at + 12 + 8] ^= 0x01;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[2]);
    crc.update(&(len as u32).to_le_bytes());
    crc.update(&out[at + 12..at + 12 + len]);
    out[at + 8..at + 12].copy_from_slice(&crc.finalize().to_le_bytes());
    out
}

#[test]
fn a_stream_with_valid_checksums_but_a_wrong_page_is_refused() {
    let (stream, _) = two_round_stream();
    // Round 2's last page (zeros sent as a byte of data), and round 1's page of the second
    // region (not sent again).
    for (from_end, region) in [
        (0, "region at guest 0x100000"),
        (3, "region at guest 0x800000"),
    ] {
        let bad = with_wrong_page(&stream, from_end);
        // Every record reads as valid: only the check of the memory finds it.
        read_all(&bad).expect("every checksum is valid");
        let err = receive(bad.as_slice()).unwrap_err();
        assert!(matches!(err, StreamError::Mismatch(_)), "{err}");
        assert!(err.to_string().contains(region), "{region}: {err}");
    }
    // A wrong page that a later round sent again is right where it lands: nothing to refuse.
    receive(with_wrong_page(&stream, 6).as_slice()).expect("round 2 sent that page again");
}

#[test]
fn the_digest_is_the_last_record_and_done_needs_it() {
    let src = source();
    guest_write(&src, MIB, 7);
    let layout = MemoryLayout::of(&src);
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&layout).unwrap();
    writer.send_all(&src).unwrap();
    writer.end_round().unwrap();
    let body = writer.get_ref().clone();
    let digest = |d: &[u8]| raw_record(8, d);
    let good = writer.digest();
    let mut good_bytes = Vec::new();
    for r in &good.regions {
        good_bytes.extend_from_slice(&r.pages.to_le_bytes());
        good_bytes.extend_from_slice(&r.sum.to_le_bytes());
    }
    let with = |records: &[Vec<u8>]| {
        let mut stream = body.clone();
        records.iter().for_each(|r| stream.extend_from_slice(r));
        read_all(&stream).map_err(|e| e.to_string())
    };
    with(&[digest(&good_bytes), raw_record(5, &[])]).expect("in order");
    for (records, expected) in [
        (vec![raw_record(5, &[])], "Done without the Digest record"),
        (
            vec![digest(&good_bytes[..16])],
            "a Digest record of 16 bytes for a layout of 3 regions",
        ),
        (
            vec![digest(&good_bytes), raw_record(3, b"state")],
            "after the Digest record (only Done may follow it)",
        ),
        (
            vec![digest(&good_bytes), digest(&good_bytes)],
            "after the Digest record",
        ),
        (
            vec![raw_pages(0, 4096), digest(&good_bytes)],
            "a Digest record inside round 2",
        ),
    ] {
        let err = with(&records).unwrap_err();
        assert!(err.contains(expected), "{expected}: {err}");
    }
    // Not before Done.
    let mut reader = StreamReader::new(Cursor::new(body.clone()));
    while let Ok(Some(_)) = reader.next_record() {}
    let err = reader.verify(&src).unwrap_err().to_string();
    assert!(err.contains("only once the whole stream"), "{err}");
}

#[test]
fn a_version_2_stream_without_a_digest_is_refused_naming_why() {
    let src = source();
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello(&MemoryLayout::of(&src)).unwrap();
    let mut stream = writer.get_ref().clone();
    let len = u32::from_le_bytes(stream[4..8].try_into().unwrap()) as usize;
    let mut payload = stream[12..12 + len].to_vec();
    payload[8..12].copy_from_slice(&2u32.to_le_bytes());
    stream = raw_record(1, &payload);
    let err = read_all(&stream).unwrap_err().to_string();
    assert!(
        err.contains("stream version 2, from an older sender whose streams carry no memory digest"),
        "{err}"
    );
}

#[test]
fn a_handed_over_region_counted_in_the_digest_is_refused() {
    let src = shared_source();
    let layout = MemoryLayout::of(&src);
    let mut writer = StreamWriter::new(Vec::new());
    writer.hello_handing_over(&layout).unwrap();
    writer.handover(&[(1, 0)]).unwrap();
    writer.end_round().unwrap();
    let mut stream = writer.get_ref().clone();
    let mut payload = vec![0u8; 48];
    payload[16] = 1; // region 1's page count
    stream.extend(raw_record(8, &payload));
    let err = read_all(&stream).unwrap_err().to_string();
    assert!(
        err.contains("counts pages in region 1, which was handed over"),
        "{err}"
    );
}

#[test]
fn a_check_cut_into_pieces_across_threads_adds_up_to_the_senders_digest() {
    // 160 MiB: three pieces of the receiver's check, pages of data in each and across the
    // boundaries between them.
    let m = MemoryManager::new(FakeKvm::new(64, true));
    m.add_region(RegionSpec::new(GuestAddress(0), 160 * MIB))
        .expect("the fake takes it");
    for gpa in [
        0,
        64 * MIB - PAGE_SIZE,
        64 * MIB,
        100 * MIB,
        128 * MIB,
        160 * MIB - 8,
    ] {
        guest_write(&m, gpa, gpa + 1);
    }
    let layout = MemoryLayout::of(&m);
    let mut writer = StreamWriter::new(std::io::sink());
    writer.hello(&layout).unwrap();
    writer.send_all(&m).unwrap();
    let sent = writer.digest();
    assert_eq!(sent.regions[0].pages, 6);
    let here = MemoryDigest::of_memory(&m, &layout, &[]).unwrap();
    assert_eq!(here, sent);
    here.check(&sent, &layout).unwrap();
}

#[test]
fn a_region_with_unreachable_ranges_under_its_slot_migrates_and_verifies() {
    // An unplugged block inside a plugged piece: one slot, a range of it PROT_NONE. Sending its
    // pages and the end-to-end digest must not fault on it; the receiver gets zeros there.
    let src = source();
    let id = src.regions()[0].id;
    for page in 0..3 * MIB / PAGE_SIZE {
        guest_write(&src, MIB + page * PAGE_SIZE, page + 1);
    }
    src.harvest_dirty(Target::All).unwrap();
    let gone = 16 * PAGE_SIZE..48 * PAGE_SIZE;
    let layout = MemoryLayout::of(&src);
    let (tx, rx) = UnixStream::pair().unwrap();
    let receiver = thread::spawn(move || receive(rx));
    let mut writer = StreamWriter::new(tx);
    writer.hello(&layout).unwrap();
    writer.send_all(&src).unwrap();
    writer.end_round().unwrap();
    // Unplugged while the first round is in flight: the next round carries the change.
    src.set_accessible(id, std::slice::from_ref(&gone), false)
        .unwrap();
    src.discard_region(id, gone.clone()).unwrap();
    let dirty = src.harvest_dirty(Target::All).unwrap();
    let second = writer.send_dirty(&src, &dirty).unwrap();
    assert_eq!(second.bytes, gone.end - gone.start, "{second:?}");
    writer.end_round().unwrap();
    writer.done().unwrap();
    drop(writer);
    // The receiver checked every page against the sender's digest.
    let (dst, _, _) = receiver.join().unwrap().unwrap();
    assert_eq!(read(&dst, MIB + gone.start), 0);
    assert_eq!(read(&dst, MIB + gone.end - 8), 0);
    assert_eq!(read(&dst, MIB + gone.end), gone.end / PAGE_SIZE + 1);
}

/// A memfd of transparent huge pages handed over keeps its page size on the receiving side
/// (a shared mapping of a memfd takes THP as the memfd region did), and is the same memory.
#[test]
fn a_handed_over_memfd_of_transparent_huge_pages_keeps_them() {
    let src = MemoryManager::new(FakeKvm::new(512, true));
    src.add_region(
        RegionSpec::new(GuestAddress(4 * MIB), 2 * MIB)
            .with_backing(Backing::Memfd)
            .with_page_size(PageSize::Transparent),
    )
    .expect("a THP memfd");
    guest_write(&src, 4 * MIB + 0x3000, 5);
    let layout = MemoryLayout::of(&src);
    let files = shared_files(&src, &layout).unwrap();
    let handed = [(0usize, files[0].1.clone())].into_iter().collect();
    let dst = MemoryManager::new(FakeKvm::new(512, true));
    layout.build_handed_over(&dst, &handed).unwrap();
    assert_eq!(dst.regions()[0].page_size, PageSize::Transparent);
    assert_eq!(read(&dst, 4 * MIB + 0x3000), 5, "the same memory");
}
