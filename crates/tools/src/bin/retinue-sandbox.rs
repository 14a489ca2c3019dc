//! `retinue-sandbox`: the terminal's sandbox helper as its own program
//! (`retinue __sandbox` is the same code inside the `retinue` binary).

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    std::process::exit(retinue_tools::sandbox::helper_main(args));
}
