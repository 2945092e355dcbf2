//! fp8 -> f32: the bit patterns of all 256 values of each format, built at compile time.
//!
//! The tables are the definition the vector loads (kernel/x86.rs, which widen through f16)
//! are tested against. e4m3fn: exponent bias 7, no infinities, S.1111.111 is NaN; e5m2:
//! exponent bias 15, IEEE infinities and NaNs (it is the top byte of an f16).

/// f32 bits of the fp8 value `byte` with `exp_bits` exponent and `man_bits` mantissa bits.
const fn widen(byte: u8, exp_bits: u32, man_bits: u32, ieee_specials: bool) -> u32 {
    let sign = ((byte as u32) >> 7) << 31;
    let man_mask = (1u32 << man_bits) - 1;
    let exp_max = (1u32 << exp_bits) - 1;
    let bias = (1i32 << (exp_bits - 1)) - 1;
    let e = ((byte as u32) >> man_bits) & exp_max;
    let mut m = (byte as u32) & man_mask;
    if ieee_specials && e == exp_max {
        return sign | if m == 0 { 0x7f80_0000 } else { 0x7fc0_0000 };
    }
    if !ieee_specials && e == exp_max && m == man_mask {
        return sign | 0x7fc0_0000;
    }
    if e == 0 {
        if m == 0 {
            return sign;
        }
        // subnormal: m * 2^(1 - bias - man_bits); normalise the mantissa
        let mut exp = 1 - bias;
        while m & (1 << man_bits) == 0 {
            m <<= 1;
            exp -= 1;
        }
        let biased = (exp + 127) as u32;
        return sign | (biased << 23) | ((m & man_mask) << (23 - man_bits));
    }
    let biased = (e as i32 - bias + 127) as u32;
    sign | (biased << 23) | (m << (23 - man_bits))
}

const fn table(exp_bits: u32, man_bits: u32, ieee_specials: bool) -> [u32; 256] {
    let mut out = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        out[i] = widen(i as u8, exp_bits, man_bits, ieee_specials);
        i += 1;
    }
    out
}

/// f32 bits of each e4m3fn byte.
pub static E4M3: [u32; 256] = table(4, 3, false);
/// f32 bits of each e5m2 byte.
pub static E5M2: [u32; 256] = table(5, 2, true);
