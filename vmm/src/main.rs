//! tinyvmm: a tiny VMM that exercises kvm-memslots at tens of thousands of KVM memory slots.

fn main() {
    println!("tinyvmm: no VM yet");
}
