//! Prints how fast this host runs guest ring-0 code (`tests/run.sh` prints it before the
//! tests, so that a slow run explains itself).

fn main() {
    match kvm_test_support::ring0_speed() {
        Some(speed) => println!(
            "guest ring-0 speed on this host: {:.2} M instructions/s (a real-mode dec/jnz \
             loop; on kvm_pvm KVM's instruction emulator runs it)",
            speed / 1e6
        ),
        None => println!("guest ring-0 speed: not measured (no usable /dev/kvm)"),
    }
}
