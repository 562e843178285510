-- Q0, pass-through: every bid as it came.
SELECT auction, bidder, price, event_time FROM bid
