//! A small, seedable pseudo-random generator (SplitMix64): reproducible
//! harness runs without a dependency. Not for secrets.

/// SplitMix64.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator with this seed.
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed }
    }

    /// A seed from the operating system's secure source (0 if it fails).
    pub fn os_seed() -> u64 {
        let mut buf = [0u8; 8];
        match getrandom::fill(&mut buf) {
            Ok(()) => u64::from_le_bytes(buf),
            Err(_) => 0x5eed_5eed,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`0` when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform index into a slice of length `n` (`0` when `n == 0`).
    pub fn index(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).unwrap_or(0)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }

    /// `true` with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// A random element of `items` (`None` when empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() { None } else { items.get(self.index(items.len())) }
    }

    /// `n` lowercase hex digits.
    pub fn hex(&mut self, n: usize) -> String {
        (0..n)
            .map(|_| {
                char::from_digit(u32::try_from(self.below(16)).unwrap_or(0), 16).unwrap_or('0')
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn deterministic_and_bounded() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            let x = a.range(3, 9);
            assert_eq!(x, b.range(3, 9));
            assert!((3..=9).contains(&x));
        }
        assert_eq!(a.hex(8).len(), 8);
        assert_eq!(Rng::new(1).below(0), 0);
    }
}
