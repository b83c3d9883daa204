//! `tinyvmm-bench`'s command line keeps `tinyvmm`'s vocabulary (`vmm/tests/cli.rs`): defaults
//! in every `--help`, usage errors with their own exit status (64), `--version` with the
//! commit.

use std::process::{Command, Output, Stdio};

use kvm_test_support::cli::{
    assert_usage_error, assert_version_and_help, help_commands, help_options, help_problems,
};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyvmm-bench"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("tinyvmm-bench runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Every subcommand, as `tinyvmm-bench help` lists them.
const SUBCOMMANDS: [&str; 4] = ["bench", "stress", "harvest-bench", "snapshot-bench"];

#[test]
fn every_help_shows_its_defaults_and_one_name_per_concept() {
    let help = text(&bench(&["--help"]).stdout);
    assert_eq!(help_commands(&help), SUBCOMMANDS, "{help}");
    for subcommand in SUBCOMMANDS {
        let output = bench(&[subcommand, "--help"]);
        assert!(output.status.success(), "{subcommand} --help");
        let help = text(&output.stdout);
        let problems = help_problems(subcommand, &help, &[]);
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        for (option, option_help) in help_options(&help) {
            if option == "--vcpus" {
                assert!(
                    option_help.contains("(1 to 15)"),
                    "{subcommand}: {option_help}"
                );
            }
        }
    }
}

#[test]
fn usage_errors_have_their_own_exit_status_and_help_and_version_succeed() {
    for args in [
        &["--bogus"][..],
        &["stress", "--seconds", "-1"],
        &["stress", "--vcpus", "16"],
        &["bench", "--slots", "1"],
        &["bench", "--tests", "nope"],
        &["harvest-bench", "--slots", "0"],
        &["snapshot-bench", "--touch", "some"],
    ] {
        assert_usage_error(args, &bench(args));
    }
    // The old names are still understood.
    let help = bench(&["bench", "--area-mib", "8", "--help"]);
    assert!(help.status.success());
    assert_version_and_help(bench, "tinyvmm-bench", env!("CARGO_PKG_VERSION"));
}

/// A slot count over what KVM offers here is a usage error (64), named before anything
/// starts, as a count under 2 is; not a failure of the run (1).
#[test]
fn kvm_a_slot_count_over_kvms_is_a_usage_error() {
    if !kvm_test_support::require_kvm("tinyvmm-bench::kvm_a_slot_count_over_kvms_is_a_usage_error")
    {
        return;
    }
    let max = kvm_ioctls::Kvm::new().expect("KVM").get_nr_memslots();
    let over = (max + 1).to_string();
    for args in [
        &["bench", "--slots", &format!("10,{over}")][..],
        &["harvest-bench", "--slots", &over],
        &["snapshot-bench", "--slots", &over],
    ] {
        let output = bench(args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("more than KVM's {max} slots")),
            "{args:?}: {stderr}"
        );
    }
}
