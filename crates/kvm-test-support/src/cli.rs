//! A binary's command line as the tests of every binary of the project read it (`tinyvmm`'s
//! and `tinyvmm-bench`'s): its `--help`'s subcommands and options, each with its help; the
//! rules every help keeps (a default shown for every option that takes a value, old names
//! hidden); a usage error's exit status and `--version`'s commit.

use std::process::Output;

/// The exit status of a usage error, in every binary of the project (sysexits' `EX_USAGE`).
pub const USAGE_EXIT_STATUS: i32 = 64;

/// Options that were renamed: they stay as hidden aliases only, so no help lists them.
pub const OLD_NAMES: [&str; 3] = ["--area-mib", "--mem-slots", "--ring-entries"];

/// The options of `--help`'s text, each with its help (the lines up to the next option).
pub fn help_options(help: &str) -> Vec<(String, String)> {
    let mut options: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("--") {
            let name = rest.split([' ', '<']).next().unwrap_or_default();
            options.push((format!("--{name}"), trimmed.to_owned()));
        } else if trimmed.starts_with("-h, --help") || trimmed.starts_with("-V, --version") {
            options.push(("--help".into(), String::new()));
        } else if let Some((_, help)) = options.last_mut() {
            help.push(' ');
            help.push_str(trimmed);
        }
    }
    options
}

/// The subcommands a `--help` lists under `Commands:` (`help` left out), in its order.
pub fn help_commands(help: &str) -> Vec<&str> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect()
}

/// Asserts that the run with `args` that gave `output` was refused as a usage error: exit
/// status [`USAGE_EXIT_STATUS`], nothing on stdout, clap's `error: ` on stderr.
pub fn assert_usage_error(args: &[&str], output: &Output) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(USAGE_EXIT_STATUS),
        "{args:?}: {stderr}"
    );
    assert!(output.stdout.is_empty(), "{args:?}");
    assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
}

/// Asserts what the binary `name` (of crate version `version`) that `run` runs says to
/// `--version` (`NAME VERSION (commit ...)`) and `--help` (the usage errors' exit status among
/// the others), both answered with success.
pub fn assert_version_and_help(run: impl Fn(&[&str]) -> Output, name: &str, version: &str) {
    let answer = run(&["--version"]);
    assert!(answer.status.success(), "{name} --version");
    let answer = String::from_utf8_lossy(&answer.stdout);
    assert!(
        answer.starts_with(&format!("{name} {version} (commit ")),
        "{answer}"
    );
    let help = run(&["--help"]);
    assert!(help.status.success(), "{name} --help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains(&format!("{USAGE_EXIT_STATUS} a usage error")),
        "{help}"
    );
}

/// What is wrong with the `--help` text `help` of `subcommand`: an old name listed, or an
/// option that takes a value, is not required and is not one of `inputs` (options that name an
/// input of the run, which has no default) showing no `[default: ...]`.
pub fn help_problems(subcommand: &str, help: &str, inputs: &[&str]) -> Vec<String> {
    let usage = help
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .unwrap_or_default();
    let mut problems = Vec::new();
    for (option, option_help) in help_options(help) {
        if OLD_NAMES.contains(&option.as_str()) {
            problems.push(format!("{subcommand} lists {option}"));
        }
        let takes_value = option_help
            .split_whitespace()
            .nth(1)
            .is_some_and(|w| w.starts_with('<'));
        let required = usage.contains(&format!("{option} <"));
        if takes_value
            && !required
            && !inputs.contains(&option.as_str())
            && !option_help.contains("[default: ")
        {
            problems.push(format!(
                "{subcommand} {option} shows no default: {option_help}"
            ));
        }
    }
    if usage.is_empty() {
        problems.push(format!("{subcommand} --help has no usage line"));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_option_without_its_default_or_under_an_old_name_is_named() {
        let help = "Usage: x run [OPTIONS] --api-sock <API_SOCK>\n\nOptions:\n      \
                    --slots <SLOTS>\n          KVM slots [default: 2]\n      \
                    --mem-mib <MEM_MIB>\n          MiB of memory\n      \
                    --area-mib <AREA_MIB>\n          old [default: 1]\n      \
                    --api-sock <API_SOCK>\n          the socket\n      \
                    --kernel <KERNEL>\n          an input\n      --json\n          JSON\n  \
                    -h, --help\n          Print help\n";
        assert_eq!(
            help_options(help)
                .iter()
                .map(|(o, _)| o.as_str())
                .collect::<Vec<_>>(),
            [
                "--slots",
                "--mem-mib",
                "--area-mib",
                "--api-sock",
                "--kernel",
                "--json",
                "--help"
            ]
        );
        assert_eq!(
            help_problems("run", help, &["--kernel"]),
            [
                "run --mem-mib shows no default: --mem-mib <MEM_MIB> MiB of memory",
                "run lists --area-mib",
            ]
        );
    }
}
