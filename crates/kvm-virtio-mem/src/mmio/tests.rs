use super::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts its triggers.
#[derive(Default)]
struct Counter(AtomicU64);

impl Interrupt for Counter {
    fn trigger(&self) -> io::Result<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// A device with two queues and an 8-byte configuration space that records what the
/// transport asks of it.
#[derive(Debug, Default)]
struct Dummy {
    config: [u8; 8],
    activated: Option<u64>,
    notified: Vec<usize>,
    resets: u32,
    fail_next: bool,
}

impl VirtioDevice for Dummy {
    fn device_id(&self) -> u32 {
        42
    }
    fn features(&self) -> u64 {
        F_VERSION_1 | 0b101
    }
    fn accept_features(&self, acked: u64) -> bool {
        // Bit 2 is required, as virtio-mem requires UNPLUGGED_INACCESSIBLE.
        acked & 0b100 != 0
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 8]
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(c) = self.config.get_mut(offset as usize + i) {
                *c = *b;
            }
        }
    }
    fn activate(&mut self, features: u64) -> Result<(), DriverError> {
        self.activated = Some(features);
        Ok(())
    }
    fn process_queue(
        &mut self,
        index: usize,
        _queue: &mut Queue,
    ) -> Result<QueueOutcome, DriverError> {
        self.notified.push(index);
        if std::mem::take(&mut self.fail_next) {
            return Err(DriverError("bad chain".into()));
        }
        Ok(QueueOutcome {
            used_buffers: true,
            config_changed: false,
        })
    }
    fn reset(&mut self) {
        self.resets += 1;
    }
}

fn transport() -> (MmioTransport<Dummy>, Arc<Counter>) {
    let irq = Arc::new(Counter::default());
    let t = MmioTransport::new(Dummy::default(), Box::new(Arc::clone(&irq)))
        .expect("valid queue sizes");
    (t, irq)
}

fn r32(t: &mut MmioTransport<Dummy>, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(offset, &mut b);
    u32::from_le_bytes(b)
}

fn w32(t: &mut MmioTransport<Dummy>, offset: u64, value: u32) {
    t.write(offset, &value.to_le_bytes());
}

fn negotiate(t: &mut MmioTransport<Dummy>, features: u64) -> u32 {
    w32(t, 0x70, 1);
    w32(t, 0x70, 3);
    w32(t, 0x24, 0);
    w32(t, 0x20, features as u32);
    w32(t, 0x24, 1);
    w32(t, 0x20, (features >> 32) as u32);
    w32(t, 0x70, 0xb);
    r32(t, 0x70)
}

#[test]
fn identity_registers() {
    let (mut t, _) = transport();
    assert_eq!(r32(&mut t, 0), 0x7472_6976);
    assert_eq!(r32(&mut t, 4), 2);
    assert_eq!(r32(&mut t, 8), 42);
    w32(&mut t, 0x14, 1);
    assert_eq!(r32(&mut t, 0x10), 1);
    w32(&mut t, 0x14, 0);
    assert_eq!(r32(&mut t, 0x10), 0b101);
    w32(&mut t, 0x30, 1);
    assert_eq!(r32(&mut t, 0x34), 8);
    w32(&mut t, 0x30, 2);
    assert_eq!(r32(&mut t, 0x34), 0);
}

#[test]
fn bad_widths_and_offsets_read_zero_and_write_nothing() {
    let (mut t, _) = transport();
    let mut two = [0xffu8; 2];
    t.read(0, &mut two);
    assert_eq!(two, [0, 0]);
    let mut four = [0xffu8; 4];
    t.read(2, &mut four);
    assert_eq!(four, [0; 4]);
    t.read(0x1000, &mut four);
    assert_eq!(four, [0; 4]);
    t.read(u64::MAX, &mut four);
    assert_eq!(four, [0; 4]);
    t.write(0x70, &[1, 0]);
    t.write(0x71, &[1, 0, 0, 0]);
    t.write(u64::MAX - 1, &[1, 0, 0, 0]);
    assert_eq!(t.status(), 0);
    let mut empty = [];
    t.read(0x100, &mut empty);
    // Configuration space: any width, zeros past its end.
    t.write(0x104, &[9, 8]);
    let mut cfg = [0u8; 8];
    t.read(0x103, &mut cfg);
    assert_eq!(cfg, [0, 9, 8, 0, 0, 0, 0, 0]);
}

#[test]
fn features_ok_needs_version_1_and_no_unknown_bits() {
    let (mut t, _) = transport();
    assert_eq!(negotiate(&mut t, 0b100), 3, "no VERSION_1");
    w32(&mut t, 0x70, 0);
    assert_eq!(
        negotiate(&mut t, F_VERSION_1 | 0b110),
        3,
        "bit 1 not offered"
    );
    w32(&mut t, 0x70, 0);
    assert_eq!(negotiate(&mut t, F_VERSION_1 | 0b1), 3, "device refuses");
    // A set bit in feature word 2 (bits 64..96, none offered).
    w32(&mut t, 0x70, 0);
    w32(&mut t, 0x70, 1);
    w32(&mut t, 0x70, 3);
    w32(&mut t, 0x24, 2);
    w32(&mut t, 0x20, 1);
    w32(&mut t, 0x24, 0);
    w32(&mut t, 0x20, 0b100);
    w32(&mut t, 0x24, 1);
    w32(&mut t, 0x20, 1);
    w32(&mut t, 0x70, 0xb);
    assert_eq!(r32(&mut t, 0x70), 3, "a bit past the first 64 was accepted");
    w32(&mut t, 0x70, 0);
    assert_eq!(negotiate(&mut t, F_VERSION_1 | 0b100), 0xb);
    assert_eq!(t.acked_features(), F_VERSION_1 | 0b100);
}

#[test]
fn notify_before_driver_ok_is_ignored_and_after_it_interrupts() {
    let (mut t, irq) = transport();
    negotiate(&mut t, F_VERSION_1 | 0b100);
    w32(&mut t, 0x30, 0);
    w32(&mut t, 0x44, 1);
    w32(&mut t, 0x50, 0);
    assert!(t.device().notified.is_empty());
    w32(&mut t, 0x70, 0xf);
    assert_eq!(t.device().activated, Some(F_VERSION_1 | 0b100));
    w32(&mut t, 0x50, 1); // queue 1 is not ready
    w32(&mut t, 0x50, 7); // no such queue
    assert!(t.device().notified.is_empty());
    w32(&mut t, 0x50, 0);
    assert_eq!(t.device().notified, [0]);
    assert_eq!(r32(&mut t, 0x60), INTERRUPT_USED_BUFFER);
    assert_eq!(irq.0.load(Ordering::SeqCst), 1);
    w32(&mut t, 0x64, INTERRUPT_USED_BUFFER);
    assert_eq!(r32(&mut t, 0x60), 0);
}

#[test]
fn a_driver_error_sets_needs_reset_until_reset() {
    let (mut t, irq) = transport();
    negotiate(&mut t, F_VERSION_1 | 0b100);
    w32(&mut t, 0x44, 1);
    w32(&mut t, 0x70, 0xf);
    t.device_mut().fail_next = true;
    w32(&mut t, 0x50, 0);
    assert_eq!(r32(&mut t, 0x70), 0x4f);
    assert_eq!(r32(&mut t, 0x60), INTERRUPT_CONFIG_CHANGE);
    assert_eq!(irq.0.load(Ordering::SeqCst), 1);
    assert_eq!(t.driver_error(), Some(&DriverError("bad chain".into())));
    // The driver rewriting its bits keeps the device's.
    w32(&mut t, 0x70, 0xf);
    assert!(t.needs_reset());
    // No processing while it waits for the reset.
    w32(&mut t, 0x50, 0);
    assert_eq!(t.device().notified, [0]);
    w32(&mut t, 0x70, 0);
    assert_eq!(r32(&mut t, 0x70), 0);
    assert_eq!(r32(&mut t, 0x60), 0);
    assert_eq!(r32(&mut t, 0x44), 0, "queues are not ready after a reset");
    assert_eq!(t.device().resets, 1);
    assert!(t.driver_error().is_none());
}

#[test]
fn a_bad_queue_size_or_ring_alignment_is_a_driver_error() {
    let (mut t, _) = transport();
    negotiate(&mut t, F_VERSION_1 | 0b100);
    w32(&mut t, 0x38, 12);
    assert!(t.needs_reset());
    w32(&mut t, 0x70, 0);
    negotiate(&mut t, F_VERSION_1 | 0b100);
    w32(&mut t, 0x38, 8);
    w32(&mut t, 0x80, 0x1008);
    assert!(t.needs_reset(), "descriptor table not 16-byte aligned");
}

#[test]
fn clearing_status_bits_without_reset_is_ignored() {
    let (mut t, _) = transport();
    negotiate(&mut t, F_VERSION_1 | 0b100);
    w32(&mut t, 0x70, 1);
    assert_eq!(r32(&mut t, 0x70), 0xb);
    // DRIVER_OK without FEATURES_OK is refused.
    let (mut t, _) = transport();
    w32(&mut t, 0x70, 1);
    w32(&mut t, 0x70, 3);
    w32(&mut t, 0x70, 7);
    assert_eq!(r32(&mut t, 0x70), 3);
    assert!(t.device().activated.is_none());
}

#[test]
fn config_change_interrupts_only_a_running_driver() {
    let (mut t, irq) = transport();
    t.config_changed();
    assert_eq!(r32(&mut t, 0xfc), 1);
    assert_eq!(irq.0.load(Ordering::SeqCst), 0);
    negotiate(&mut t, F_VERSION_1 | 0b100);
    w32(&mut t, 0x70, 0xf);
    t.config_changed();
    assert_eq!(r32(&mut t, 0xfc), 2);
    assert_eq!(r32(&mut t, 0x60), INTERRUPT_CONFIG_CHANGE);
    assert_eq!(irq.0.load(Ordering::SeqCst), 1);
}
