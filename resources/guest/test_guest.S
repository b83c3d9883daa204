# tinyvmm's built-in test guest: 64-bit code that runs in ring 3 (user mode runs natively even
# under software-only virtualisation, where ring 0 is emulated) and executes commands the host
# posts in a per-vCPU command block. Plain instructions only (no SSE, XSAVE or syscall), but
# for the VEX commands (5, 6), which need AVX enabled by the VMM (CR4.OSXSAVE, XCR0 = 7).
#
# The VMM loads this code at CODE_GPA and enters it in ring 3 with IOPL 3, identity page tables,
# rsi = the vCPU's command block and rsp = its stack. Layout of a command block (u64 fields):
#   0x00 cmd_seq   host: bumped to post a command     0x08 done_seq  guest: = cmd_seq when done
#   0x10 op        1 write, 2 verify, 3 write loop, 4 exit, 5 vex write, 6 vex verify,
#                  7 exec (write a stub and call it), 8 call (call the stub already there)
#   0x18 start     0x20 end      0x28 stride    0x30 seed     (the range [start, end))
#   0x38 stop      host: 1 ends a write loop after the current pass; 2 (cancel) ends any
#                  command where it is, within CHECK_EVERY addresses
#   0x40 result    guest: verify's first bad address (0: all good; -1: unknown op)
#   0x48 found     guest: the value found there      0x50 passes  guest: write-loop passes done
#   0x58 cut_at    guest: 0 if the command ran to its end; else, cancelled, the first address
#                  of the range it did not reach (every stride-th address below it is done)
# The value of a page at address a written with seed s is a ^ s (a u64 at a). The VEX commands
# store and load 32 bytes at each address a (a multiple of 32) with one `vmovdqu ymm`: the four
# u64 at a, a+8, a+16, a+24, each holding its own address ^ s. Exec and call run an 8-byte stub
# at each address a (`lea rax, [rip - 7]; ret`, which returns its own address): exec first
# stores it there with a plain `mov`; both report the address as bad (result) if the stub did
# not return it (found).
#
# Ring 0 is used only for exceptions: each vector's stub stores the vector and the top of the
# exception stack in the fault block (FAULT_GPA) and reports it on PORT_FAULT.

.intel_syntax noprefix
.code64

.set CMD_SEQ, 0x00
.set DONE_SEQ, 0x08
.set OP, 0x10
.set START, 0x18
.set END, 0x20
.set STRIDE, 0x28
.set SEED, 0x30
.set STOP, 0x38
.set RESULT, 0x40
.set FOUND, 0x48
.set PASSES, 0x50
.set CUT_AT, 0x58

.set STOP_NOW, 2                        # `stop` value that cancels a command where it is
.set CHECK_EVERY, 64                    # addresses between two looks at `stop`

# Counts an address down in r13 and, every CHECK_EVERY, looks at `stop`: jumps to `cut` if it
# says cancel.
.macro cancel_point cut
    dec r13
    jnz 9f
    mov r13, CHECK_EVERY
    cmp qword ptr [rbx + STOP], STOP_NOW
    jae \cut
9:
.endm

# The head of a command's walk over its range: rcx from r8 while below r9 (then on to `over`),
# looking at `stop` every CHECK_EVERY addresses (r13 counts them down; a cancel goes to
# `cut`). The walk's loop is the label 1 it leaves: the body goes on with rcx + r10 to 1b.
.macro walk over, cut
    mov rcx, r8
    mov r13, CHECK_EVERY
1:  cmp rcx, r9
    jae \over
    cancel_point \cut
.endm

.set OP_WRITE, 1
.set OP_VERIFY, 2
.set OP_WRITE_LOOP, 3
.set OP_EXIT, 4
.set OP_VEX_WRITE, 5
.set OP_VEX_VERIFY, 6
.set OP_EXEC, 7
.set OP_CALL, 8

# lea rax, [rip - 7]; ret: 48 8d 05 f9 ff ff ff c3, as one little-endian u64.
.set STUB, 0xc3fffffff9058d48

.set PORT_DONE, 0x510
.set PORT_EXIT, 0x511
.set PORT_FAULT, 0x512

.set FAULT_GPA, 0x1f00

.text
# Offset 0: the entry point.
entry:
    jmp start

# Offset 0x100: 32 exception stubs of 16 bytes each, one per vector.
.org 0x100
.set vector, 0
.rept 32
    .balign 16
    push vector
    jmp fault
    .set vector, vector + 1
.endr

.balign 16
fault:
    pop rax
    mov qword ptr [FAULT_GPA], rax
    mov rcx, qword ptr [rsp]
    mov qword ptr [FAULT_GPA + 0x08], rcx
    mov rcx, qword ptr [rsp + 0x08]
    mov qword ptr [FAULT_GPA + 0x10], rcx
    mov rcx, qword ptr [rsp + 0x10]
    mov qword ptr [FAULT_GPA + 0x18], rcx
    mov rcx, qword ptr [rsp + 0x18]
    mov qword ptr [FAULT_GPA + 0x20], rcx
    mov rcx, qword ptr [rsp + 0x20]
    mov qword ptr [FAULT_GPA + 0x28], rcx
    mov dx, PORT_FAULT
    out dx, eax
1:  hlt
    jmp 1b

start:
    mov rbx, rsi                        # rbx: the command block, for the whole run
    mov r15, qword ptr [rbx + DONE_SEQ] # first report ready, as if a command had just ended
    jmp done

next_command:
    mov rax, qword ptr [rbx + CMD_SEQ]
    cmp rax, qword ptr [rbx + DONE_SEQ]
    jne have_command
    pause
    jmp next_command

have_command:
    mov r15, rax                        # r15: this command's sequence number
    mov qword ptr [rbx + CUT_AT], 0
    mov r8, qword ptr [rbx + START]
    mov r9, qword ptr [rbx + END]
    mov r10, qword ptr [rbx + STRIDE]
    mov r11, qword ptr [rbx + SEED]
    mov rax, qword ptr [rbx + OP]
    cmp rax, OP_WRITE
    je op_write
    cmp rax, OP_VERIFY
    je op_verify
    cmp rax, OP_WRITE_LOOP
    je op_write_loop
    cmp rax, OP_EXIT
    je op_exit
    cmp rax, OP_VEX_WRITE
    je op_vex_write
    cmp rax, OP_VEX_VERIFY
    je op_vex_verify
    cmp rax, OP_EXEC
    je op_exec
    cmp rax, OP_CALL
    je op_exec
    mov qword ptr [rbx + RESULT], -1
    jmp done

op_write:
    call write_pass
    jmp done

op_verify:
    mov qword ptr [rbx + RESULT], 0
    walk done, cut_short
    mov rax, rcx
    xor rax, r11
    mov rdx, qword ptr [rcx]
    cmp rdx, rax
    jne mismatch
    add rcx, r10
    jmp 1b

op_write_loop:
    xor r12, r12                        # r12: passes completed
    mov qword ptr [rbx + PASSES], 0
1:  mov r11, qword ptr [rbx + SEED]
    add r11, r12                        # pass k writes a ^ (seed + k)
    call write_pass
    cmp qword ptr [rbx + CUT_AT], 0     # a cancelled pass is no pass
    jne done
    inc r12
    mov qword ptr [rbx + PASSES], r12
    cmp qword ptr [rbx + STOP], 0
    je 1b
    jmp done

op_exit:
    mov dx, PORT_EXIT
    out dx, al
    jmp op_exit

# 32 bytes at each address with one VEX store: built on the stack (always memory), then stored.
op_vex_write:
    sub rsp, 32
    walk vex_done, vex_cut
    xor rsi, rsi                        # rsi: the u64 of the 32 bytes
2:  lea rax, [rcx + rsi * 8]
    xor rax, r11
    mov qword ptr [rsp + rsi * 8], rax
    inc rsi
    cmp rsi, 4
    jb 2b
    vmovdqu ymm0, ymmword ptr [rsp]
    vmovdqu ymmword ptr [rcx], ymm0
    add rcx, r10
    jmp 1b

# 32 bytes at each address with one VEX load, copied to the stack and checked there.
op_vex_verify:
    mov qword ptr [rbx + RESULT], 0
    sub rsp, 32
    walk vex_done, vex_cut
    vmovdqu ymm0, ymmword ptr [rcx]
    vmovdqu ymmword ptr [rsp], ymm0
    xor rsi, rsi
2:  lea rax, [rcx + rsi * 8]
    xor rax, r11
    mov rdx, qword ptr [rsp + rsi * 8]
    cmp rdx, rax
    jne 5f
    inc rsi
    cmp rsi, 4
    jb 2b
    add rcx, r10
    jmp 1b
5:  lea rax, [rcx + rsi * 8]
    mov qword ptr [rbx + FOUND], rdx
    mov qword ptr [rbx + RESULT], rax
    jmp vex_done

# The VEX commands' end: cancelled (rcx is the first address not reached) or not, their 32
# bytes of stack given back.
vex_cut:
    mov qword ptr [rbx + CUT_AT], rcx
vex_done:
    add rsp, 32
    jmp done

# Exec (rax = OP_EXEC) stores the stub at each address, then calls it; call only calls it.
op_exec:
    mov r14, rax                        # r14: which of the two
    mov qword ptr [rbx + RESULT], 0
    walk done, cut_short
    cmp r14, OP_EXEC
    jne 2f
    mov rax, STUB
    mov qword ptr [rcx], rax
2:  xor rax, rax
    call rcx                            # the stub leaves every register but rax alone
    mov rdx, rax
    cmp rdx, rcx
    jne mismatch
    add rcx, r10
    jmp 1b

# Writes a ^ r11 at a = r8, r8 + r10, ... below r9; on a cancel, stops early and stores the
# first address it did not write in cut_at.
write_pass:
    walk 2f, 4f
    mov rax, rcx
    xor rax, r11
    mov qword ptr [rcx], rax
    add rcx, r10
    jmp 1b
4:  mov qword ptr [rbx + CUT_AT], rcx
2:  ret

# A check that read rdx at rcx, not what it expected: the command's result.
mismatch:
    mov qword ptr [rbx + FOUND], rdx
    mov qword ptr [rbx + RESULT], rcx
    jmp done

# A command cancelled: rcx is the first address it did not reach.
cut_short:
    mov qword ptr [rbx + CUT_AT], rcx
    jmp done

done:
    mov qword ptr [rbx + DONE_SEQ], r15
    mov dx, PORT_DONE
    out dx, al
    jmp next_command
