//! PrefillBudget's unit tests (the cross-core parity is tests/test_core_budget.py).

use super::*;

#[test]
fn mixed_decode_tokens_are_charged_up_front() {
    let b = PrefillBudget::new(1, 100, Some(50), 10).unwrap();
    assert_eq!((b.rem_input_tokens(), b.rem_chunk_tokens()), (90, Some(40)));
    assert_eq!((b.total_offset(), b.current_offset()), (10, 10));
}

#[test]
fn reserve_running_clips_and_floors() {
    let mut b = PrefillBudget::new(1, 100, None, 0).unwrap();
    let got = b
        .reserve_running(&[10_000, 3, -5], &[false, false, true], 0.5)
        .unwrap();
    assert_eq!(got, 2048 + 1);
    assert_eq!(b.total_offset(), 2049);
    assert!(b.reserve_running(&[1], &[], 0.5).is_err());
    assert!(b.reserve_running(&[1], &[true], f64::NAN).is_err());
}

#[test]
fn add_req_charges_pages_and_decode_tokens() {
    let mut b = PrefillBudget::new(16, 10_000, None, 0).unwrap();
    let (ok, state, granted) = b.add_req(100_000, 0, 20, 100).unwrap();
    assert!(ok);
    assert_eq!((state, granted), (AddReqResult::Continue, 20));
    assert_eq!(b.total_offset(), 32 + 16 + 100);
    assert_eq!(b.current_offset(), 48);
    assert_eq!(b.rem_input_tokens(), 10_000 - 32);
    // Not strictly under the remaining memory: NO_TOKEN.
    let avail = b.total_offset() as i64 + 10 + 5 + 16;
    assert_eq!(
        b.add_req(avail, 0, 10, 5).unwrap(),
        (false, AddReqResult::NoToken, 0)
    );
}

#[test]
fn input_budget_refuses_all_but_the_first() {
    let mut b = PrefillBudget::new(1, 10, None, 0).unwrap();
    assert_eq!(
        b.add_req(1000, 0, 50, 0).unwrap(),
        (true, AddReqResult::Other, 50)
    );
    assert_eq!(
        b.add_req(1000, 0, 1, 0).unwrap(),
        (false, AddReqResult::Other, 0)
    );
}

#[test]
fn chunking_cuts_on_a_page_boundary() {
    let mut b = PrefillBudget::new(4, 1000, Some(10), 0).unwrap();
    // prefix 2 + floor_page(10)=8 -> end 8 (page aligned) -> granted 6, no decode reserve.
    let (ok, state, granted) = b.add_req(10_000, 2, 30, 100).unwrap();
    assert!(ok);
    assert_eq!(granted, 6);
    assert_eq!(state, AddReqResult::Continue);
    assert_eq!(b.total_offset(), 8 + 4);
    assert_eq!(b.rem_chunk_tokens(), Some(2));
}

#[test]
fn add_chunk_always_progresses() {
    let mut b = PrefillBudget::new(4, 1000, Some(3), 0).unwrap();
    let (_, granted) = b.add_chunk(10_000, 1, 100, 5).unwrap();
    assert_eq!(granted, 3); // (1 + 3) // 4 * 4 - 1
    let (_, granted) = b.add_chunk(10_000, 0, 100, 5).unwrap();
    assert_eq!(granted, 4); // cut is 0: max(floor_page(chunk), ps) = 4
    let mut off = PrefillBudget::new(4, 1000, None, 0).unwrap();
    assert!(off.add_chunk(10, 0, 1, 0).is_err());
}

#[test]
fn negative_budgets_use_floor_division() {
    let b = PrefillBudget::new(4, 0, Some(0), 5).unwrap();
    assert_eq!(b.rem_chunk_tokens(), Some(-5));
    assert_eq!(b.floor_page(-5), -8);
    assert_eq!(b.ceil_page(-5), -4);
    assert_eq!(b.state(100).unwrap(), AddReqResult::Other);
}

#[test]
fn max_new_tokens_limit_is_add_reqs_rule() {
    for ps in [1, 4, 16] {
        for (capacity, prompt_len) in [(64, 1), (64, 17), (1000, 333), (4000, 60)] {
            let limit = PrefillBudget::max_new_tokens_limit(capacity, ps, prompt_len).unwrap();
            assert_eq!(limit, i128::from(capacity - ps - prompt_len - 1));
            let max_new = i64::try_from(limit).unwrap();
            let mut b = PrefillBudget::new(ps, 10_000, None, 0).unwrap();
            assert!(b.add_req(capacity, 0, prompt_len, max_new).unwrap().0);
            let mut b = PrefillBudget::new(ps, 10_000, None, 0).unwrap();
            assert_eq!(
                b.add_req(capacity, 0, prompt_len, max_new + 1).unwrap(),
                (false, AddReqResult::NoToken, 0)
            );
        }
    }
    assert_eq!(PrefillBudget::max_new_tokens_limit(0, 1, 0).unwrap(), -2);
    assert!(PrefillBudget::max_new_tokens_limit(-1, 1, 0).is_err());
    assert!(PrefillBudget::max_new_tokens_limit(1, 0, 0).is_err());
    assert!(PrefillBudget::max_new_tokens_limit(1, 1, -1).is_err());
    let extreme = PrefillBudget::max_new_tokens_limit(0, i64::MAX, i64::MAX).unwrap();
    assert_eq!(extreme, -2 * i128::from(i64::MAX) - 1);
}

#[test]
fn shortfall_is_the_distance_to_add_reqs_rule() {
    for ps in [1, 4, 16] {
        let mut b = PrefillBudget::new(ps, 10_000, None, 0).unwrap();
        b.reserve_running(&[300], &[true], 0.7).unwrap();
        for (avail, extend, max_new) in [(1000, 50, 100), (400, 50, 100), (300, 1, 9000)] {
            let short = b.shortfall(avail, extend, max_new).unwrap();
            let short_i64 = i64::try_from(short).unwrap();
            assert_eq!(
                b.clone().add_req(avail, 0, extend, max_new).unwrap().0,
                short == 0
            );
            if short > 0 {
                let fits = b.clone().add_req(avail + short_i64, 0, extend, max_new);
                assert!(fits.unwrap().0);
                let still = b.clone().add_req(avail + short_i64 - 1, 0, extend, max_new);
                assert!(!still.unwrap().0);
            }
        }
        assert_eq!(b.total_offset(), 300); // charges nothing
    }
    let b = PrefillBudget::new(1, 10, None, 0).unwrap();
    assert!(b.shortfall(10, 0, 1).is_err());
    assert!(b.shortfall(-1, 1, 1).is_err());
}

#[test]
fn bad_sizes_are_rejected() {
    assert!(PrefillBudget::new(0, 1, None, 0).is_err());
    assert!(PrefillBudget::new(1, -1, None, 0).is_err());
    let mut b = PrefillBudget::new(1, 10, None, 0).unwrap();
    assert!(b.add_req(10, 0, 0, 0).is_err());
    assert!(b.state(-1).is_err());
}

#[test]
fn whole_life_counts_what_everyone_grows_while_it_lives() {
    let mut b = PrefillBudget::new(1, 10_000, None, 0).unwrap();
    b.reserve_running(&[5000, 3, 5000], &[true, true, true], 1.0)
        .unwrap();
    // 8 + 8 + 1 for itself; each running one min(remaining, 8 + 2) + 1.
    assert_eq!(b.whole_life_need(8, 8).unwrap(), 17 + 11 + 4 + 11);
    // The memory rule refuses it (room 43 - 8192 < 0); the whole-life rule admits it.
    assert_eq!(
        b.add_req(43, 0, 8, 8).unwrap(),
        (false, AddReqResult::NoToken, 0)
    );
    assert_eq!(
        b.add_req_whole_life(42, 0, 8, 8).unwrap(),
        (false, AddReqResult::NoToken, 0)
    );
    let (ok, _, granted) = b.add_req_whole_life(43, 0, 8, 8).unwrap();
    assert!(ok && granted == 8);
    assert_eq!(b.current_offset(), 9);
    // The next one also counts the first one's life.
    assert_eq!(b.whole_life_need(8, 8).unwrap(), 9 + 17 + 26 + 8 + 1);
}

#[test]
fn whole_life_never_cuts() {
    let mut b = PrefillBudget::new(4, 10_000, Some(16), 0).unwrap();
    assert_eq!(
        b.add_req_whole_life(10_000, 0, 17, 1).unwrap(),
        (false, AddReqResult::Other, 0)
    );
}
