//! README.md documents every subcommand `gpualloc --help` lists, and every
//! option of each, and puts the command on PATH before it first uses it.

use std::process::Command;

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args(args)
        .arg("-h")
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// The first word of each line of the section `title` of a help text, or
/// with `long`, its first word that starts with `--`.
fn section(text: &str, title: &str, long: bool) -> Vec<String> {
    text.lines()
        .skip_while(|l| l.trim() != title)
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            if long {
                words.find(|w| w.starts_with("--"))
            } else {
                words.next()
            }
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn readme_documents_every_subcommand_and_option() {
    let readme = include_str!("../../README.md");
    let commands: Vec<String> = section(&help(&[]), "Commands:", false)
        .into_iter()
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 8, "{commands:?}");
    for c in &commands {
        assert!(
            readme.contains(&format!("| `{c} ")),
            "README.md's command table lacks `{c}`"
        );
        for opt in section(&help(&[c]), "Options:", true) {
            // `-o OUT` stands for `--output` in the table.
            if opt == "--help" || opt == "--output" {
                continue;
            }
            assert!(
                readme.contains(opt.as_str()),
                "README.md does not mention `gpualloc {c} {opt}`"
            );
        }
    }
    let path = readme
        .find("export PATH=$PWD/target/release:$PATH")
        .unwrap();
    let first_use = readme.find("\ngpualloc ").unwrap();
    assert!(
        path < first_use,
        "README.md uses gpualloc before putting it on PATH"
    );
}
