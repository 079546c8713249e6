// A cap on work in flight: at most `limit` items (all-gathers whose memory is
// not yet released, reduce-scatters not yet finished) outstanding. Past the cap
// the oldest item is settled before new work starts: the CPU blocks on it
// (make_room()), or a device stream is ordered after it (make_room(settle)),
// instead of letting the allocator grow. Items are anything with done() and
// wait(); dropping an item releases what it keeps alive.
#pragma once

#include <deque>
#include <utility>

namespace fsdp {

template <class Item>
class InflightQueue {
 public:
  explicit InflightQueue(int limit = 0) : limit_(limit) {}
  void set_limit(int limit) { limit_ = limit; }  // 0 = unlimited

  // Call before starting new work: drops finished items, then blocks on the
  // oldest until fewer than `limit` remain. Returns how many it blocked on.
  int make_room() {
    return make_room([](const Item& item) { item.wait(); });
  }
  // The same with settle(item) in place of blocking on each oldest item: what
  // the item keeps alive is then dropped at once, so settle must order every
  // later use of that memory after the item (a stream wait on its event).
  template <class Settle>
  int make_room(Settle&& settle) {
    drop_finished();
    int settled = 0;
    for (; limit_ > 0 && static_cast<int>(items_.size()) >= limit_; ++settled) {
      settle(items_.front());
      items_.pop_front();
    }
    return settled;
  }
  void push(Item item) { items_.push_back(std::move(item)); }
  // Drops every item; only when their work is known to be ordered before
  // anything that could reuse what they keep alive.
  void clear() { items_.clear(); }
  void drop_finished() {
    while (!items_.empty() && items_.front().done()) items_.pop_front();
  }

  size_t size() const { return items_.size(); }
  // Whether make_room() would block now (after drop_finished()).
  bool full() const { return limit_ > 0 && static_cast<int>(items_.size()) >= limit_; }

 private:
  std::deque<Item> items_;
  int limit_;
};

}  // namespace fsdp
