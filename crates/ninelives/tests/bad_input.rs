//! Bad input gets a clear one-line error and a non-zero exit, never a panic.

use crate::common;

use common::*;

#[test]
fn missing_kvm_device_is_a_clear_error() {
    let o = ninelives()
        .args(["run", "--duration", "0.1"])
        .env(nl_vmm::KVM_DEVICE_ENV, "/nonexistent/kvm")
        .output()
        .unwrap();
    assert_clean_error(&o, "cannot open the KVM device (/nonexistent/kvm");
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn bad_command_line_values_are_refused() {
    for (args, needle) in [
        (vec!["run", "--mem", "1M"], "too small"),
        (vec!["run", "--mem", "12X"], "unknown unit"),
        (vec!["run", "--mem", "64M", "--ws", "64M"], "guest memory too small"),
        (vec!["run", "--vcpus", "0"], "out of range"),
        (vec!["run", "--vcpus", "33"], "out of range"),
        (vec!["run", "--vms", "0"], "out of range"),
        (vec!["run", "--duration=-1"], "duration"),
        (vec!["run", "--duration", "nan"], "duration"),
        (vec!["run", "--ws", "12345"], "invalid workload parameters"),
        (vec!["run", "--write-pct", "101"], "101"),
        (vec!["run", "--workload", "nope"], "invalid value"),
        (vec!["run", "--kernel", "/nonexistent/kernel"], "cannot read --kernel"),
    ] {
        let o = run_cli(&args);
        assert_clean_error(&o, needle);
    }
}

#[test]
fn kernels_that_are_not_elf_or_do_not_fit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let not_elf = write_file(dir.path(), "not-elf", b"this is not an ELF image at all");
    let o = run_cli(&["run", "--kernel", &not_elf]);
    assert_clean_error(&o, "not a valid ELF");
    if !kvm_available() {
        return;
    }
    // The user program is a valid ELF, but linked where no kernel may go.
    let user = write_file(dir.path(), "user-as-kernel", nl_guest::USER_ELF);
    let o = run_cli(&["run", "--kernel", &user]);
    assert_clean_error(&o, "does not fit");
    // A segment reaching past the kernel range.
    let huge =
        tiny_elf(&vec![0x90; (nl_abi::KERNEL_STACKS_GPA - nl_abi::KERNEL_BASE) as usize + 1]);
    let big = write_file(dir.path(), "too-big", &huge);
    let o = run_cli(&["run", "--kernel", &big]);
    assert_clean_error(&o, "does not fit");
}

#[test]
fn guest_triple_fault_is_reported() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // ud2 with no IDT: #UD -> #GP -> double fault -> triple fault.
    let k = write_file(dir.path(), "ud2", &tiny_elf(&[0x0f, 0x0b]));
    let o = run_cli(&["run", "--kernel", &k, "--duration", "0.2", "--json"]);
    assert_clean_error(&o, "triple fault");
    assert_eq!(o.status.code(), Some(1));
    let j = last_json(&o);
    assert_eq!(j["vms"][0]["ok"], false);
    assert_eq!(j["vms"][0]["digest_ok"], false);
}

#[test]
fn guest_that_stops_heartbeating_is_detected() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let k = write_file(dir.path(), "spin", &tiny_elf(&[0xeb, 0xfe])); // jmp $
    let o = run_cli(&["run", "--kernel", &k, "--duration", "0.2", "--heartbeat-timeout", "0.5"]);
    assert_clean_error(&o, "stopped heartbeating");
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn guest_reported_errors_are_failures() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let err_reg = nl_abi::control_reg(0, nl_abi::reg::ERROR);
    let mut code = vec![0x48, 0xb8]; // mov rax, imm64
    code.extend_from_slice(&err_reg.to_le_bytes());
    code.extend_from_slice(&[0x48, 0xc7, 0x00, 0x0d, 0x01, 0x00, 0x00]); // mov qword [rax], 0x10d
    code.extend_from_slice(&[0xeb, 0xfe]);
    let k = write_file(dir.path(), "gp", &tiny_elf(&code));
    let o = run_cli(&["run", "--kernel", &k, "--duration", "0.2"]);
    assert_clean_error(&o, "general protection");
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn wild_port_io_and_mmio_are_answered_and_counted() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let info = nl_abi::control_reg(0, nl_abi::reg::ERROR_INFO);
    let mut code = Vec::new();
    // mov rax, 0xD0100000 (unclaimed MMIO inside the mapped device page)
    code.extend_from_slice(&[0x48, 0xb8]);
    code.extend_from_slice(&0xD010_0000u64.to_le_bytes());
    code.extend_from_slice(&[0x48, 0xc7, 0x00, 0x01, 0x00, 0x00, 0x00]); // mov qword [rax], 1
    code.extend_from_slice(&[0x48, 0x8b, 0x18]); // mov rbx, [rax]
    code.extend_from_slice(&[0xe6, 0x99]); // out 0x99, al (no device)
    code.extend_from_slice(&[0xe4, 0x99]); // in al, 0x99
    code.extend_from_slice(&[0x48, 0xb8]); // mov rax, ERROR_INFO
    code.extend_from_slice(&info.to_le_bytes());
    code.extend_from_slice(&[0x48, 0x89, 0x18]); // mov [rax], rbx
    code.extend_from_slice(&[0x48, 0xc7, 0x40, 0xf8, 0x34, 0x12, 0x00, 0x00]); // mov qword [rax-8], 0x1234 (ERROR)
    code.extend_from_slice(&[0xeb, 0xfe]);
    let k = write_file(dir.path(), "wild", &tiny_elf(&code));
    let o = run_cli(&["run", "--kernel", &k, "--duration", "0.2"]);
    // The VMM answered the wild read with all ones and kept running to see the report.
    assert_clean_error(&o, "guest error 0x1234 (info 0xffffffffffffffff)");
    assert_eq!(o.status.code(), Some(1));
}
